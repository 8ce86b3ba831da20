"""Settings of the head and export sections of a recipe."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HeadConfig:
    # null: copy from the target (hidden size, heads, intermediate size, rope, max positions).
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    # Initialise the draft lm_head from the target's lm_head rows of the draft vocabulary.
    init_lm_head_from_target: bool = False


@dataclass
class ExportConfig:
    formats: list[str] | None = None  # null: ["sglang", "speculators"]
    dtype: str = "bfloat16"
    # Chain length written into speculators_config and the serving snippets (null: from the bench).
    num_speculative_tokens: int | None = None
