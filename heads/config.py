"""Settings of the head and export sections of a recipe (choices are Literals, ranges field metadata: checked
at load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class HeadConfig:
    # null: copy from the target (hidden size, heads, intermediate size, rope, max positions).
    hidden_size: int | None = field(default=None, metadata={"min": 1})
    intermediate_size: int | None = field(default=None, metadata={"min": 1})
    num_attention_heads: int | None = field(default=None, metadata={"min": 1})
    num_key_value_heads: int | None = field(default=None, metadata={"min": 1})
    # Initialise the draft lm_head from the target's lm_head rows of the draft vocabulary.
    init_lm_head_from_target: bool = False
    # Start the decoder layer as a copy of this target layer (its q/k/v weights on both the embedding and the
    # aux halves of its input), fc as a pass-through of the highest aux layer and the final norm as the
    # target's. null: random (the published EAGLE-3 initialisation; measured: docs/results-quality.md).
    init_from_target_layer: int | None = field(default=None, metadata={"min": 0})

    def cross_check(self) -> None:
        # Grouped-query attention shares each key/value head among a whole number of query heads (checked
        # here when both are set; an unset one comes from the target).
        q, kv = self.num_attention_heads, self.num_key_value_heads
        if q is not None and kv is not None and q % kv:
            raise ValueError(f"num_key_value_heads: must divide num_attention_heads ({q}), got {kv}")


@dataclass
class ExportConfig:
    # sglang (also loads in vLLM) | vllm | speculators; `eyas run` writes each under export/<format>/.
    formats: list[Literal["sglang", "vllm", "speculators"]] = field(
        default_factory=lambda: ["sglang", "speculators"], metadata={"min_len": 1})
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # Chain length written into speculators_config and the serving snippets (null: from the bench).
    num_speculative_tokens: int | None = field(default=None, metadata={"min": 1})
