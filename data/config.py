"""Settings of the data stage (each dataclass is one section of a recipe)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class CorpusConfig:
    # sharegpt | chitchat | stdlib | jsonl | json | hf | text | code
    kind: str = "sharegpt"
    # File or directory; null means the packaged default for `kind`.
    path: str | None = None
    max_records: int | None = None
    # Share of the final mixture drawn from this corpus (records), 1.0 = all of it.
    weight: float = 1.0
    # For text/code corpora: file glob and how documents become samples.
    glob: str = "**/*"


@dataclass
class DataConfig:
    corpora: list[CorpusConfig] = field(default_factory=lambda: [CorpusConfig()])
    max_length: int = 512
    # truncate | drop, for sequences over max_length.
    overflow: str = "truncate"
    validation_fraction: float = 0.02
    # Train only on the first assistant turn's conversation prefix (cheaper), or all turns.
    max_turns: int | None = None
    min_assistant_tokens: int = 8
    # Regenerate assistant turns with the target's own answers.
    regenerate: bool = False
    regenerate_max_new_tokens: int = 256
    regenerate_batch_size: int = 16
    regenerate_temperature: float = 0.0
    regenerate_max_records: int | None = None
    seed: int = 0


@dataclass
class VocabConfig:
    draft_vocab_size: int = 8192
    # If set, use the smallest size (from `sizes`) whose masked-token coverage reaches it.
    coverage_target: float | None = None
    sizes: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768])


@dataclass
class CollectConfig:
    # offline: store shards on disk; online: run the target inside the training loop.
    mode: str = "offline"
    batch_size: int = 8
    # What the loss needs from the target: "last_hidden" (recompute logits through norm+lm_head) or
    # "topk" (top-k log-probs over the draft vocab).
    teacher: str = "last_hidden"
    topk: int = 64
    # bf16 | fp8 storage for the aux features.
    feature_dtype: str = "bfloat16"
    shard_tokens: int = 65536
    max_records: int | None = None
