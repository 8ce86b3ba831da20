"""Settings of the data stage (each dataclass is one section of a recipe).

Choices are `Literal`s; ranges are field metadata (min/max inclusive, gt/lt exclusive, pattern, min_len, len,
read by eyas.configbase); `cross_check` holds rules between fields. The recipe loader checks all of them when a
recipe loads; constructing these dataclasses directly checks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


# Conversation corpora (messages) and completion corpora (documents); the readers dispatch on these.
ChatKind = Literal["sharegpt", "chitchat", "json", "jsonl", "hf"]
CompletionKind = Literal["humaneval", "stdlib", "text", "code"]
CorpusKind = Literal[ChatKind, CompletionKind]


@dataclass
class TargetConfig:
    # A local HF directory, a Hub id, or a named default ("smollm2-135m-instruct", "gemma3-270m").
    name_or_path: str = "smollm2-135m-instruct"
    # auto: bf16 on CUDA, fp32 on CPU.
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] = "auto"
    device: str = field(default="auto", metadata={"pattern": (r"auto|cpu|cuda(:\d+)?", "auto, cpu, cuda or cuda:N")})
    # "Stream entering layer k" ids (vLLM convention); null means [2, N//2, N-3].
    aux_layer_ids: list[int] | None = field(default=None, metadata={"min": 0, "min_len": 1})
    trust_remote_code: bool = False
    # "auto" shards a target too large for one device over all visible GPUs (offline collection of 70B).
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | None = None


@dataclass
class CorpusConfig:
    kind: CorpusKind = "sharegpt"
    # File or directory; null means the packaged default for `kind` (sharegpt, chitchat, humaneval, stdlib).
    path: str | None = None
    max_records: int | None = field(default=None, metadata={"min": 1})
    # Share of this corpus's records drawn into the mixture, 1.0 = all of it.
    weight: float = field(default=1.0, metadata={"gt": 0, "max": 1})
    # For text/code corpora: file glob and how documents become samples.
    glob: str = "**/*"
    # Label written to the `category` column and used to group held-out prompts; null: chat for
    # conversation corpora, code for code kinds, text for plain text. "auto" (conversation corpora) labels
    # each conversation by the kind of traffic its first request is: chat, code, summarization, creative
    # or reasoning (data/traffic.py), so a mixed corpus gives a held-out set that mixes kinds of traffic.
    category: str | None = None
    # A request template holding "{text}": each record becomes a one-turn chat request built from its text
    # (a document's text, HumanEval's prompt, a conversation's first answer), which regeneration answers; e.g.
    # "Summarize the following text in two sentences.\n\n{text}" turns prose into summarization traffic.
    # With category null or auto, the request is labelled by its own text. The records share their source's
    # train/validation split.
    request: str | None = field(default=None, metadata={"pattern": (r"(?s).*\{text\}.*", 'a template holding "{text}"')})
    # Only texts of [min, max] characters become requests (a summary of a whole file is another task).
    request_chars: list[int] | None = field(default=None, metadata={"min": 1, "len": 2})
    # Regenerate this corpus's answers (null: data.regenerate). false keeps the corpus's own answers, so a
    # recipe can mix the target's answers with original ones.
    regenerate: bool | None = None


@dataclass
class DataConfig:
    corpora: list[CorpusConfig] = field(default_factory=lambda: [CorpusConfig()], metadata={"min_len": 1})
    max_length: int = field(default=512, metadata={"min": 2})
    # For sequences over max_length.
    overflow: Literal["truncate", "drop"] = "truncate"
    validation_fraction: float = field(default=0.02, metadata={"min": 0, "lt": 1})
    # Keep at most this many assistant turns per conversation (later turns dropped); null keeps all.
    max_turns: int | None = field(default=None, metadata={"min": 1})
    min_assistant_tokens: int = field(default=8, metadata={"min": 1})
    # Regenerate assistant turns with the target's own answers (first assistant turn only; later
    # turns are dropped, because the user's follow-ups answered the original reply).
    regenerate: bool = False
    regenerate_max_new_tokens: int = field(default=256, metadata={"min": 1})
    # What generates the answers: transformers (HF generate, in this process, batches of batch_size) or
    # vllm (the serving engine as a local server, `regenerate_concurrency` requests in flight: several
    # times faster, docs/data-engine.md).
    regenerate_engine: Literal["transformers", "vllm"] = "transformers"
    regenerate_batch_size: int = field(default=16, metadata={"min": 1})
    regenerate_concurrency: int = field(default=64, metadata={"min": 1})
    # Weights' dtype in the engine; auto: the target's (float32 on a CPU). bfloat16 is about 2x faster on
    # CPUs with AMX, but its greedy answers drift from what the float32 target says.
    regenerate_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    regenerate_temperature: float = field(default=0.0, metadata={"min": 0})
    regenerate_max_records: int | None = field(default=None, metadata={"min": 1})
    # Only prompts of at most this many tokens are regenerated (the others are dropped); null: any prompt
    # that leaves room for an answer within max_length. Short prompts make regeneration much cheaper.
    regenerate_max_prompt_tokens: int | None = field(default=None, metadata={"min": 1})
    # Shares of the kinds of traffic among the records regenerated (up to regenerate_max_records), e.g.
    # {chat: 0.4, code: 0.2, summarization: 0.1, creative: 0.15, reasoning: 0.15}; null: corpus order. A kind
    # with too few records leaves its share to the others; kinds not named are not regenerated.
    category_mix: dict[str, float] | None = field(default=None, metadata={"min": 0})
    # Held-out prompts written to data/prompts.jsonl, per category, taken from the validation split: every
    # validation record whose prompt fits (regenerated or not: the bench needs prompts, not answers).
    prompts_per_category: int = field(default=64, metadata={"min": 1})
    seed: int = 0

    def cross_check(self) -> None:
        # A sequence must hold a prompt and at least min_assistant_tokens of answer.
        if self.min_assistant_tokens >= self.max_length:
            raise ValueError(f"min_assistant_tokens: must be below max_length ({self.max_length}), "
                             f"got {self.min_assistant_tokens}")


@dataclass
class VocabConfig:
    draft_vocab_size: int = field(default=8192, metadata={"min": 1})
    # If set, use the smallest size (from `sizes`) whose masked-token coverage reaches it.
    coverage_target: float | None = field(default=None, metadata={"gt": 0, "max": 1})
    sizes: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768],
                             metadata={"min": 1, "min_len": 1})
    # When the training data holds fewer distinct tokens than draft_vocab_size: false is an error,
    # true shrinks the draft vocabulary to the distinct tokens (never padded with unseen ids).
    shrink_to_distinct: bool = False
    # Past the tokens the training answers use, fill the draft vocabulary with the tokens most frequent in
    # the corpora's original answers and documents (data/reference_counts.safetensors): a few hundred
    # answers leave many of the target's later tokens unseen, and a token outside the draft vocabulary is
    # never accepted. Its lm_head row starts from the target's (head.init_lm_head_from_target).
    fill_from_corpora: bool = False
    # Validation positions on which the target's argmax is computed for the coverage report; 0 skips it.
    argmax_positions: int = field(default=2048, metadata={"min": 0})
    argmax_batch_size: int = field(default=8, metadata={"min": 1})


@dataclass
class CollectConfig:
    # offline: store shards on disk; online: run the target inside the training loop.
    mode: Literal["offline", "online"] = "offline"
    batch_size: int = field(default=8, metadata={"min": 1})
    # What the loss needs from the target: "last_hidden" (the final normed hidden; logits are recomputed
    # as hidden @ lm_head_rows.T over the draft vocab, exact up to bf16 rounding) or "topk" (the top-k
    # target logits over the draft vocab; the rest of the distribution is dropped, an approximation).
    teacher: Literal["last_hidden", "topk"] = "last_hidden"
    topk: int = field(default=64, metadata={"min": 1})
    # Storage of the top-k logits (fp16 keeps 3 more mantissa bits than bf16).
    topk_dtype: Literal["float16", "fp16", "bfloat16", "bf16"] = "float16"
    # Storage of the aux features (fp8 keeps a power-of-two scale per token and layer).
    feature_dtype: Literal["bfloat16", "bf16", "float8_e4m3", "float8_e4m3fn", "fp8"] = "bfloat16"
    shard_tokens: int = field(default=65536, metadata={"min": 1})
    # Per split, the first N records of the prepared dataset; null = all.
    max_records: int | None = field(default=None, metadata={"min": 1})
    # Positions per chunk when computing full-vocabulary logits for the argmax (bounds memory).
    logits_chunk: int = field(default=1024, metadata={"min": 1})
    # The target's matmuls while it computes features (offline and online): fp32 as loaded, bf16 under autocast,
    # or auto (bf16 where the device computes it fast: CUDA, CPUs with AMX / AVX512-BF16). bf16 features round
    # differently from the fp32 target the head drafts for (docs/results-quality.md measures what that costs).
    mixed_precision: Literal["auto", "fp32", "bf16"] = "fp32"
