"""The target model with its own KV cache, fed positions and attention masks explicitly.

Both decoders run the target through this one class (same cache, dtype and masks), so plain and
speculative speeds compare like with like. The mask is additive and 4D: the cached prefix plus, among the
new tokens, either causal attention or a draft tree's ancestor relation. The cache keeps every entry of
every layer (eval/kv_cache.py), so sliding-window layers get their window from the mask instead.
"""

from __future__ import annotations

import torch

from eyas.data.model_config import text_config
from eyas.data.targets import capture_aux_hidden
from eyas.eval.kv_cache import keep_rows, new_cache


class TargetRunner:
    """The target with its own cache, whose entries are exactly positions 0..length-1 of the sequence."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        tc = text_config(model.config)
        types = getattr(tc, "layer_types", None) or []
        self.sliding_window = getattr(tc, "sliding_window", None) if "sliding_attention" in types else None
        self.cache = new_cache()
        self.length = 0
        self.forwards = 0

    def mask(self, positions: torch.Tensor, allowed: torch.Tensor | None):
        """Additive 4D mask [1,1,q,length+q]: the cached prefix plus `allowed` [q,q] among new tokens."""
        q = positions.shape[-1]
        if allowed is None:
            allowed = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        visible = torch.cat([torch.ones(q, self.length, dtype=torch.bool, device=self.device), allowed], dim=1)
        full = self._additive(visible)
        if self.sliding_window is None:
            return full
        kv_pos = torch.cat([torch.arange(self.length, device=self.device), positions[0]])
        in_window = positions[0][:, None] - kv_pos[None, :] < self.sliding_window
        return {"full_attention": full, "sliding_attention": self._additive(visible & in_window)}

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        blocked = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, blocked)[None, None]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None = None,
                last_only: bool = False):
        """Logits [q,V] (or [1,V] with last_only) and, when capturing, the aux features [1,q,3H]."""
        kwargs = dict(input_ids=ids, position_ids=positions, attention_mask=self.mask(positions, allowed),
                      past_key_values=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if self.aux_layer_ids is None:
            out, aux = self.model(**kwargs), None
        else:
            with capture_aux_hidden(self.model, self.aux_layer_ids) as captured:
                out = self.model(**kwargs)
            aux = torch.cat(captured, dim=-1)
        self.length += ids.shape[1]
        self.forwards += 1
        return out.logits[0], aux

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """Keep the new entries `rows` (indices from `start`, ascending) at start, start+1, ...; drop the rest."""
        self.length = keep_rows(self.cache, start, rows)
