"""The EAGLE-3 draft head: fc over three target features, one Llama decoder layer, norm, lm_head.

Position t reads the target features of token t and the embedding of token t+1 and predicts token t+2.
Parameter names are exactly those SGLang and vLLM load (`midlayer.*`); docs/serving-format.md lists
what the engines expect. The target's token embedding is not part of the head: callers
pass embeddings (`embed(target_embedding_weight, ids)`), so it is never saved or trained.

The attention itself is left to the caller through `qkv()` and `finish()`: training composes the
training-time-test mask, the decoder a KV cache and a tree mask, both over the same projections.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # "stream entering layer k" (vLLM convention)
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    # transformers' rope parameters of the target: {"rope_type": ..., "rope_theta": ..., scaling keys}
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False

    # ---- conversions ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Eagle3Config":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def sglang_aux_layer_ids(self) -> list[int]:
        """SGLang reads eagle_config ids as 'output of layer i' and adds 1."""
        return [i - 1 for i in self.aux_layer_ids]

    def llama_config(self):
        """A transformers LlamaConfig with this head's layer shape (for rotary embeddings and export)."""
        from transformers import LlamaConfig

        rope = dict(self.rope_parameters or {})
        cfg = LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, num_hidden_layers=1, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act, attention_bias=self.attention_bias, mlp_bias=self.mlp_bias,
            rope_parameters=rope,
        )
        return cfg

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: list[int],
                    hidden_size: int | None = None, intermediate_size: int | None = None,
                    num_attention_heads: int | None = None, num_key_value_heads: int | None = None) -> "Eagle3Config":
        from eyas.data.model_config import text_config

        tc = text_config(target_config)
        hidden = hidden_size or tc.hidden_size
        heads = num_attention_heads or tc.num_attention_heads
        kv_heads = num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
        head_dim = getattr(tc, "head_dim", None) if hidden == tc.hidden_size and heads == tc.num_attention_heads else None
        head_dim = head_dim or hidden // heads
        return cls(
            hidden_size=hidden,
            intermediate_size=intermediate_size or tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tc.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            num_target_layers=tc.num_hidden_layers,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=tc.max_position_embeddings,
            rope_parameters=target_rope_parameters(tc),
            hidden_act="silu",
        )


def target_rope_parameters(tc) -> dict:
    """The target's rope settings in transformers' `rope_parameters` form (global attention's, if split)."""
    rope = getattr(tc, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:  # Gemma3: per attention type
        rope = rope["full_attention"]
    if not rope:
        rope = {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)}
        if getattr(tc, "rope_scaling", None):
            rope.update(tc.rope_scaling)
    rope = {k: v for k, v in dict(rope).items() if v is not None}
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        # The layer's input is cat(embedding, features): width 2H.
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # d2t is an offset: target_id = draft_id + d2t[draft_id]; t2d marks target ids in the draft vocab.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        llama = c.llama_config()
        rope_type = c.rope_parameters.get("rope_type", "default")
        # Rope frequencies are computed on the CPU even when the head is built on the meta device.
        with torch.device("cpu"):
            if rope_type == "default":
                base = float(c.rope_parameters.get("rope_theta", 10000.0))
                inv_freq = 1.0 / (base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim))
                self.attention_scaling = 1.0
            else:
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](llama, "cpu")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    # ---- vocabulary ------------------------------------------------------------------------------
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_target_ids(self) -> torch.Tensor:
        """Target id of every draft id, in draft order."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- the layer, in pieces ----------------------------------------------------------------------
    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B,T,hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def fuse(self, aux_features: torch.Tensor) -> torch.Tensor:
        """Three target features [B,T,3*Ht] -> [B,T,H]."""
        return self.fc(aux_features)

    def qkv(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor):
        """Roped q [B,nh,T,hd], k and v [B,nkv,T,hd], and the residual (un-normed hidden)."""
        c = self.config
        m = self.midlayer
        x = torch.cat((m.input_layernorm(embeds.to(hidden.dtype)), m.hidden_norm(hidden)), dim=-1)
        b, t, _ = x.shape
        q = m.self_attn.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(position_ids, q.dtype)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v, hidden

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [B,nh,T,hd] -> the layer's output hidden [B,T,H] (pre final norm)."""
        m = self.midlayer
        b, _, t, _ = attn_out.shape
        h = residual + m.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        return h + m.mlp(m.post_attention_layernorm(h))

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from the layer output."""
        return self.lm_head(self.norm(hidden_out))

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Plain attention with a boolean mask [B or 1, 1, Tq, Tk] (True = may attend)."""
        return F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask,
                                              scale=self.config.head_dim ** -0.5)

    def forward(self, aux_features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass (the first TTT step): returns (draft logits, output hidden)."""
        hidden = self.fuse(aux_features)
        q, k, v, residual = self.qkv(hidden, embeds, position_ids)
        if mask is None:
            t = q.shape[2]
            mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None, None]
        out = self.finish(self.attend(q, k, v, mask), residual)
        return self.logits(out), out


def embed(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The target's plain embedding lookup (no model-specific scaling, as the serving engines do)."""
    return F.embedding(ids, weight)


def build_head(config: Eagle3Config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Eagle3Head:
    head = Eagle3Head(config)
    # Small init keeps early training stable; Linear's default init is too large for the 2H input.
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return head.to(device=device, dtype=dtype)
