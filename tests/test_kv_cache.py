"""The cache adapter against transformers' real DynamicCache: keeping the accepted rows of a tree forward
leaves exactly the cache that a plain forward of the kept tokens builds. If transformers changes the cache
internals that eval/kv_cache.py edits, these tests fail."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_target
from eyas.eval.kv_cache import keep_rows, new_cache

VOCAB = 64
PREFIX = 8  # under Gemma3's sliding window (16), so one mask serves both layer types
# Root r, then a (child of r), b (child of r), c (child of b), d (child of c), at positions 8, 9, 9, 10, 11.
TREE_TOKENS = torch.tensor([[11, 12, 13, 14, 15]])
TREE_POSITIONS = torch.tensor([[8, 9, 9, 10, 11]])
TREE_ALLOWED = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 1, 1, 1]],
                            dtype=torch.bool)


def forward(model, cache, ids, positions, visible):
    """A forward that appends to `cache`, attending where `visible` [q, cached + q] is True."""
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        mask = {"full_attention": mask, "sliding_attention": mask}
    return model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                 use_cache=True).logits


def causal(q: int, cached: int = 0) -> torch.Tensor:
    return torch.cat([torch.ones(q, cached, dtype=torch.bool), torch.ones(q, q, dtype=torch.bool).tril()], 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("keep", [[0, 2, 3, 4], [0, 1], [0]], ids=["gather", "crop", "root-only"])
def test_kept_rows_equal_a_forward_of_the_kept_tokens(arch, keep):
    model = tiny_target(arch, VOCAB, layers=3)
    prefix = torch.randint(3, VOCAB, (1, PREFIX), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = new_cache()
        forward(model, cache, prefix, torch.arange(PREFIX)[None], causal(PREFIX))
        tree_visible = torch.cat([torch.ones(5, PREFIX, dtype=torch.bool), TREE_ALLOWED], 1)
        forward(model, cache, TREE_TOKENS, TREE_POSITIONS, tree_visible)
        assert cache.get_seq_length() == PREFIX + 5

        length = keep_rows(cache, PREFIX, torch.tensor(keep))
        assert length == cache.get_seq_length() == PREFIX + len(keep)

        reference = new_cache()
        kept = torch.cat([prefix, TREE_TOKENS[:, keep]], 1)
        forward(model, reference, kept, torch.arange(length)[None], causal(length))
        assert len(cache.layers) == len(reference.layers) == 3
        for got, want in zip(cache.layers, reference.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        # The next step reads the kept cache as it reads one built without a tree.
        nxt, position = torch.tensor([[16]]), torch.tensor([[length]])
        torch.testing.assert_close(forward(model, cache, nxt, position, causal(1, length)),
                                   forward(model, reference, nxt, position, causal(1, length)), atol=1e-5, rtol=1e-5)


def test_a_cache_with_sliding_window_layers_is_refused():
    """A cache built from the config drops old entries in its sliding layers: rows cannot be kept uniformly."""
    model = tiny_target("gemma3", VOCAB, layers=3)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
    with pytest.raises(TypeError, match="new_cache"):
        keep_rows(cache, 1, torch.tensor([0]))
