"""Settings of the data stage (each dataclass is one section of a recipe)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class TargetConfig:
    # A local HF directory, a Hub id, or a named default ("smollm2-135m-instruct", "gemma3-270m").
    name_or_path: str = "smollm2-135m-instruct"
    # float32 | bfloat16 | float16 | auto (bf16 on CUDA, fp32 on CPU).
    dtype: str = "auto"
    device: str = "auto"
    # "Stream entering layer k" ids (vLLM convention); null means [2, N//2, N-3].
    aux_layer_ids: list[int] | None = None
    trust_remote_code: bool = False
    # "auto" shards a target too large for one device over all visible GPUs (offline collection of 70B).
    device_map: str | None = None


@dataclass
class CorpusConfig:
    # sharegpt | chitchat | humaneval | stdlib | jsonl | json | hf | text | code
    kind: str = "sharegpt"
    # File or directory; null means the packaged default for `kind` (sharegpt, chitchat, humaneval, stdlib).
    path: str | None = None
    max_records: int | None = None
    # Share of the final mixture drawn from this corpus (records), 1.0 = all of it.
    weight: float = 1.0
    # For text/code corpora: file glob and how documents become samples.
    glob: str = "**/*"
    # Label written to the `category` column and used to group held-out prompts; null: chat for
    # conversation corpora, code for sharegpt-less code kinds, text for plain text.
    category: str | None = None


@dataclass
class DataConfig:
    corpora: list[CorpusConfig] = field(default_factory=lambda: [CorpusConfig()])
    max_length: int = 512
    # truncate | drop, for sequences over max_length.
    overflow: str = "truncate"
    validation_fraction: float = 0.02
    # Keep at most this many assistant turns per conversation (later turns dropped); null keeps all.
    max_turns: int | None = None
    min_assistant_tokens: int = 8
    # Regenerate assistant turns with the target's own answers (first assistant turn only; later
    # turns are dropped, because the user's follow-ups answered the original reply).
    regenerate: bool = False
    regenerate_max_new_tokens: int = 256
    regenerate_batch_size: int = 16
    regenerate_temperature: float = 0.0
    regenerate_max_records: int | None = None
    # Only prompts of at most this many tokens are regenerated (the others are dropped); null: any prompt
    # that leaves room for an answer within max_length. Short prompts make regeneration much cheaper.
    regenerate_max_prompt_tokens: int | None = None
    # Held-out prompts written to data/prompts.jsonl, per category, taken from the validation split.
    prompts_per_category: int = 64
    seed: int = 0

    def __post_init__(self):
        # YAML gives plain mappings for list items; the recipe loader only builds top-level sections.
        self.corpora = [_corpus_config(c, i) for i, c in enumerate(self.corpora)]
        if self.overflow not in ("truncate", "drop"):
            raise ValueError(f"data.overflow must be 'truncate' or 'drop', got {self.overflow!r}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be at least 2, got {self.max_length}")


def _corpus_config(item, index: int) -> CorpusConfig:
    if isinstance(item, CorpusConfig):
        return item
    if not isinstance(item, dict):
        raise ValueError(f"data.corpora[{index}]: expected a mapping, got {item!r}")
    valid = {f.name for f in fields(CorpusConfig)}
    unknown = sorted(set(item) - valid)
    if unknown:
        raise ValueError(f"unknown key 'data.corpora[{index}].{unknown[0]}' (valid keys: {', '.join(sorted(valid))})")
    return CorpusConfig(**item)


@dataclass
class VocabConfig:
    draft_vocab_size: int = 8192
    # If set, use the smallest size (from `sizes`) whose masked-token coverage reaches it.
    coverage_target: float | None = None
    sizes: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768])
    # When the training data holds fewer distinct tokens than draft_vocab_size: false is an error,
    # true shrinks the draft vocabulary to the distinct tokens (never padded with unseen ids).
    shrink_to_distinct: bool = False
    # Validation positions on which the target's argmax is computed for the coverage report; 0 skips it.
    argmax_positions: int = 2048
    argmax_batch_size: int = 8


@dataclass
class CollectConfig:
    # offline: store shards on disk; online: run the target inside the training loop.
    mode: str = "offline"
    batch_size: int = 8
    # What the loss needs from the target: "last_hidden" (the final normed hidden; logits are recomputed
    # as hidden @ lm_head_rows.T over the draft vocab, exact up to bf16 rounding) or "topk" (the top-k
    # target logits over the draft vocab; the rest of the distribution is dropped, an approximation).
    teacher: str = "last_hidden"
    topk: int = 64
    # float16 | bfloat16 storage of the top-k logits (fp16 keeps 3 more mantissa bits).
    topk_dtype: str = "float16"
    # bfloat16 | float8_e4m3 storage of the aux features (fp8 keeps a power-of-two scale per token and layer).
    feature_dtype: str = "bfloat16"
    shard_tokens: int = 65536
    # Per split, the first N records of the prepared dataset; null = all.
    max_records: int | None = None
    # Positions per chunk when computing full-vocabulary logits for the argmax (bounds memory).
    logits_chunk: int = 1024
