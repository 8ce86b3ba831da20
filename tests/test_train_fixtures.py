"""Tiny real pieces for the train tests: a random-weight Llama target, a draft vocab, batches and a head."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.data.targets import logits_from_final_hidden, target_features
from eyas.heads.eagle3 import Eagle3Config, build_head
from eyas.train.loss import DenseTeacher

AUX_IDS = [1, 2, 3]


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def draft_vocab_from(model, ids: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the `size` target ids the target predicts most often on `ids`, sorted by id."""
    _, final = target_features(model, ids, AUX_IDS)
    argmax = logits_from_final_hidden(model, final).argmax(-1).flatten()
    counts = torch.bincount(argmax, minlength=model.config.vocab_size)
    keep = counts.argsort(descending=True)[:size].sort().values
    d2t = keep - torch.arange(size)
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[keep] = True
    return d2t, t2d


def tiny_head(model, d2t, t2d, seed: int = 1):
    cfg = Eagle3Config.from_target(model.config, draft_vocab_size=len(d2t), aux_layer_ids=AUX_IDS)
    torch.manual_seed(seed)
    head = build_head(cfg)
    head.set_vocab(d2t, t2d)
    return head


def tiny_ids(model, batch: int = 3, seq: int = 16, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def tiny_batch(model, d2t, t2d, batch: int = 3, seq: int = 16, pad: int = 3, seed: int = 2):
    """A right-padded batch with a random loss mask, and the dense teacher over the draft vocab."""
    ids = tiny_ids(model, batch, seq, seed)
    g = torch.Generator().manual_seed(seed + 1)
    attention = torch.ones(batch, seq, dtype=torch.bool)
    attention[-1, seq - pad:] = False
    ids[~attention] = 0
    loss_mask = (torch.rand(batch, seq, generator=g) < 0.85).long() * attention.long()
    aux, final = target_features(model, ids, AUX_IDS, attention_mask=attention.long())
    full_logits = logits_from_final_hidden(model, final)
    draft_rows = torch.arange(len(d2t)) + d2t
    out = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention, "aux": aux,
           "target_in_draft": t2d[full_logits.argmax(-1)]}
    return out, DenseTeacher(full_logits[..., draft_rows])
