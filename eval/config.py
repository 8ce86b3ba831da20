"""Settings of the bench, gate and push sections of a recipe."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecoderConfig:
    # chain | tree
    mode: str = "tree"
    num_speculative_tokens: int = 4  # chain length K
    depth: int = 5  # tree depth
    topk: int = 4  # children per expanded node
    budget: int = 16  # draft tokens verified per step
    # Skip drafting when the head's confidence is this low (dynamic tree); 0 disables.
    min_draft_prob: float = 0.0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int = 0  # sampling generator seed


@dataclass
class BenchConfig:
    # JSONL with `prompt` or `messages` and optional `category`; null = held-out prompts from the data stage.
    prompts: str | None = None
    num_prompts: int = 16
    warmup: int = 2
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    # Also time transformers generate() greedy and with prompt lookup decoding.
    compare_hf: bool = True
    # Draft length of transformers' prompt lookup decoding in the comparison (its documented default is 10).
    prompt_lookup_num_tokens: int = 10
    # Chain length at which alpha is measured; null: export.num_speculative_tokens, else decoder.num_speculative_tokens.
    alpha_chain_length: int | None = None
    autotune: bool = False
    # auto: on the CPU, time two matmul layouts per row count on the target's and head's linear layers and
    # use the faster (data/linear_kernels.py); plain and speculative decoding both run with it. off: stock.
    linear_kernels: str = "auto"
    seed: int = 0

    def __post_init__(self):
        if self.linear_kernels not in ("auto", "off"):
            raise ValueError(f"bench.linear_kernels must be 'auto' or 'off', got {self.linear_kernels!r}")


@dataclass
class GateConfig:
    min_alpha: float = 0.55
    min_speedup: float | None = None
    max_itl_p99_regression: float | None = None
    # category -> traffic weight for a blended verdict; empty = pooled figures.
    weights: dict[str, float] = field(default_factory=dict)
    per_category: bool = False


@dataclass
class PushConfig:
    repo_id: str | None = None
    private: bool = False
    license: str | None = None
