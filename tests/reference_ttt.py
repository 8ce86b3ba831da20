"""The by-hand TTT reference and a dense teacher: test-only pieces that check eyas.train.loss.

`ttt_loss_reference` computes the loss of eyas.train.loss one sequence, one step and one position at a
time, building each query's key set by hand, so the fast batched `ttt_loss` can be compared against it.
"""

from __future__ import annotations

import torch

from eyas.heads.eagle3 import Eagle3Head, embed
from eyas.train.loss import TTTResult, soft_cross_entropy


class DenseTeacher:
    """Teacher logits over the draft vocab given directly as [B,T,Vd] (tests, and anything precomputed)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def logits_at(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.logits[b, t].float()


def ttt_loss_reference(head: Eagle3Head, embed_weight: torch.Tensor, batch: dict, teacher,
                       ttt_steps: int = 7, step_weight_decay: float = 0.8, target_shift: int = 2) -> TTTResult:
    """Slow, obviously-correct TTT: one sequence, one step, one position at a time, key sets built by hand.

    `target_shift` is the distance from the position to the token it predicts at step 0 (2 is right; tests
    pass 1 to show that the known bug, an unshifted loss mask, is caught).
    """
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    attn, in_draft = batch["attention_mask"].bool(), batch["target_in_draft"].bool()
    bsz, seq = ids.shape
    scale = head.config.head_dim ** -0.5
    loss_terms = [[] for _ in range(ttt_steps)]
    correct = [0] * ttt_steps
    count = [0] * ttt_steps
    accepted = positions = 0
    for b in range(bsz):
        hidden = [head.fuse(batch["aux"][b, t][None, None]) for t in range(seq)]  # each [1,1,H]
        keys = {}  # (step, position) -> (k [1,nh,1,hd], v)
        hit = {}  # (step, position) -> draft argmax == target argmax
        for k in range(ttt_steps):
            queries = {}
            for t in range(seq):
                token = ids[b, t + k + 1] if t + k + 1 < seq else torch.zeros((), dtype=ids.dtype)
                pos = torch.tensor([[t + k]], device=ids.device)
                q, kk, vv, residual = head.qkv(hidden[t], embed(embed_weight, token.view(1, 1)), pos)
                queries[t] = (q, residual)
                keys[(k, t)] = (head.repeat_kv(kk), head.repeat_kv(vv))
            new_hidden = []
            for t in range(seq):
                q, residual = queries[t]
                key_set = [keys[(0, s)] for s in range(t + 1) if attn[b, s]]
                key_set += [keys[(j, t)] for j in range(1, k + 1)]
                scores = torch.stack([(q.float() * kv[0].float()).sum(-1) * scale for kv in key_set], dim=-1)
                weights = scores.softmax(-1)  # [1,nh,1,n_keys]
                out = sum(weights[..., i, None] * kv[1].float() for i, kv in enumerate(key_set)).to(q.dtype)
                h = head.finish(out, residual)
                new_hidden.append(h)
                target = t + k + target_shift
                if not (target < seq and attn[b, target] and loss_mask[b, target] == 1 and in_draft[b, target - 1]):
                    continue
                draft_logits = head.logits(h)[0, 0]
                teacher_logits = teacher.logits_at(torch.tensor([b]), torch.tensor([target - 1]))
                ce = soft_cross_entropy(draft_logits[None], teacher_logits.softmax(-1))[0]
                loss_terms[k].append(ce)
                count[k] += 1
                hit[(k, t)] = bool(draft_logits.argmax() == teacher_logits[0].argmax())
                correct[k] += hit[(k, t)]
            hidden = new_hidden
        for t in range(seq):
            if all((k, t) in hit for k in range(ttt_steps)):
                positions += 1
                for k in range(ttt_steps):
                    if not hit[(k, t)]:
                        break
                    accepted += 1
    step_losses = torch.stack([torch.stack(terms).mean() if terms else torch.zeros(()) for terms in loss_terms])
    weights = torch.tensor([step_weight_decay ** k for k in range(ttt_steps)])
    return TTTResult(
        loss=(weights * step_losses).sum(),
        step_losses=step_losses.detach().float(),
        step_correct=torch.tensor(correct),
        step_count=torch.tensor(count),
        accepted=torch.tensor(accepted),
        positions=torch.tensor(positions),
    )
