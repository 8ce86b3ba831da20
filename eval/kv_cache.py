"""The one place that reaches into transformers' cache internals: a DynamicCache whose rows can be kept.

Verifying a draft tree appends one cache entry per tree node; afterwards only the accepted path may stay,
moved to consecutive positions. transformers offers no call for that (`DynamicCache.crop` only cuts the
tail), so `keep_rows` edits each layer's `keys` / `values` tensors ([batch, kv heads, seq, head dim]) in
place. tests/test_kv_cache.py checks the result against recomputing the kept tokens, so a change of
those internals in a new transformers release fails there first.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache() -> DynamicCache:
    """An empty cache whose every layer keeps all its entries (sliding windows are left to the mask)."""
    # No config: every layer is a DynamicLayer. With a config, sliding-window layers would drop old
    # entries on their own, and rows could no longer be gathered uniformly across layers.
    return DynamicCache()


def keep_rows(cache: DynamicCache, start: int, rows: torch.Tensor) -> int:
    """Keep the entries at `start + rows` (rows ascending) at start, start+1, ...; drop everything after.

    Entries before `start` stay as they are. Returns the new length, start + len(rows).
    """
    end = start + rows.shape[0]
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"keep_rows handles DynamicLayer only, got {type(layer).__name__}: build the cache "
                            "with new_cache()")
        layer.keys[:, :, start:end] = layer.keys[:, :, start + rows]
        layer.values[:, :, start:end] = layer.values[:, :, start + rows]
        layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
    return end
