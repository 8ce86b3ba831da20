"""The few facts about a Hugging Face model config that the data stages and the head both need."""

from __future__ import annotations


def text_config(config):
    """The decoder's own config (multimodal configs nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default feature layers: low, middle and high ("stream entering layer k", vLLM's convention)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(ids: list[int] | None, num_layers: int) -> list[int]:
    ids = list(ids) if ids else default_aux_layer_ids(num_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if len(ids) != 3 or bad:
        raise ValueError(f"target.aux_layer_ids must be 3 ids in [0, {num_layers}), got {ids}")
    return ids
