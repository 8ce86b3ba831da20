"""Training-time test (TTT): the EAGLE-3 loss over several drafting steps.

The shift is the one SGLang and vLLM draft with: position t holds the target's features of token t and
the embedding of token t+1, and predicts token t+2, trained towards the target's own next-token
distribution at t+1. The loss mask shifts with the prediction: a position counts when the token it
predicts is loss-masked (reading the mask one position early is a known bug). At TTT step k, position t reads
  hidden  fc(aux_t) at step 0, else the head's own output hidden at position t from step k-1,
  embed   token t+k+1,   RoPE position t+k,
and predicts token t+k+2, whose target distribution is the teacher at position t+k+1. It counts iff
t+k+2 < T, attention_mask[t+k+2], loss_mask[t+k+2] == 1 and target_in_draft[t+k+1].
Attention at step k: the query at t sees step-0 keys at positions <= t plus the key at position t of
every step 1..k (as in the EAGLE-3 paper and SpecForge).

`ttt_loss` computes this with one batched score matrix per step plus per-step diagonal scores; the tests
check it against a by-hand reference that builds every query's key set one position at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.heads.eagle3 import Eagle3Head, embed

MASKED = torch.finfo(torch.float32).min


TEACHER_FIELDS = ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logits")


class BatchTeacher:
    """The teacher of a collected batch (teacher_hidden or top-k fields), evaluated only where the loss needs it.

    `teacher` is eyas.data.features.Teacher: its draft_logits turns a batch's teacher fields into [B,T,Vd].
    """

    def __init__(self, teacher, batch: dict):
        self.teacher = teacher
        self.fields = {k: batch[k] for k in TEACHER_FIELDS if k in batch}
        if not self.fields:
            raise KeyError(f"batch has no teacher fields (expected one of {TEACHER_FIELDS}), has {sorted(batch)}")

    def logits_at(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.teacher.draft_logits({k: v[b, t][None] for k, v in self.fields.items()})[0].float()


@dataclass
class TTTResult:
    loss: torch.Tensor  # weighted sum of the per-step mean losses (with grad)
    step_losses: torch.Tensor  # [K] mean loss per step (detached, fp32)
    step_correct: torch.Tensor  # [K] positions where draft argmax == target argmax
    step_count: torch.Tensor  # [K] valid positions per step
    accepted: torch.Tensor  # leading-correct steps summed over positions valid at every step
    positions: torch.Tensor  # number of positions valid at every step

    def counters(self) -> torch.Tensor:
        """Everything a validation pass sums across batches and ranks, as one fp64 vector (see `summarise`)."""
        return torch.cat([self.step_losses.double() * self.step_count.double(), self.step_correct.double(),
                          self.step_count.double(), torch.stack([self.accepted, self.positions]).double()])


def summarise(counters: torch.Tensor, ttt_steps: int) -> dict:
    """Pooled per-step loss, top-1 accuracy and the simulated acceptance length tau_sim from summed counters."""
    k = ttt_steps
    loss_sum, correct, count = counters[:k], counters[k:2 * k], counters[2 * k:3 * k]
    accepted, positions = counters[3 * k].item(), counters[3 * k + 1].item()
    per = count.clamp(min=1)
    return {
        "step_loss": (loss_sum / per).tolist(),
        "step_acc": (correct / per).tolist(),
        "step_count": count.long().tolist(),
        "tau_sim": 1.0 + accepted / max(positions, 1),
        "tau_positions": int(positions),
    }


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t+n] at t, `fill` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)[:, : x.shape[1]]


def step_valid(batch: dict, k: int) -> torch.Tensor:
    """Bool [B,T]: position t is trained at TTT step k (see the module docstring for the shift)."""
    target_pos = shift_left(batch["loss_mask"].bool() & batch["attention_mask"].bool(), k + 2, False)
    return target_pos & shift_left(batch["target_in_draft"].bool(), k + 1, False)


def soft_cross_entropy(draft_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy of the draft distribution against the teacher's (zero outside a top-k)."""
    logp = draft_logits.float().log_softmax(-1)
    return -(teacher_probs * logp).sum(-1)


LOSSES = ("kl", "hard", "lk", "kl+lk")


def draft_loss(kind: str, draft_logits: torch.Tensor, teacher_probs: torch.Tensor,
               teacher_argmax: torch.Tensor) -> torch.Tensor:
    """Per-row training loss of the draft logits against the teacher at the same positions.

    kl     cross-entropy against the teacher's distribution (forward KL up to a constant; EAGLE-3's loss)
    hard   cross-entropy against the teacher's argmax only (greedy serving accepts exactly that token)
    lk     -log of the acceptance probability sum_x min(p(x), q(x)) of sampled speculative decoding: the
           acceptance rate itself, in the negative-log form of the LK losses (whose gradient does not
           vanish as the plain total-variation distance's does)
    kl+lk  the sum of the two
    """
    if kind == "hard":
        return torch.nn.functional.cross_entropy(draft_logits.float(), teacher_argmax, reduction="none")
    out = soft_cross_entropy(draft_logits, teacher_probs) if kind in ("kl", "kl+lk") else 0.0
    if kind in ("lk", "kl+lk"):
        accept = torch.minimum(draft_logits.float().softmax(-1), teacher_probs).sum(-1)
        out = out - accept.clamp_min(1e-6).log()
    return out


def ttt_attention(head: Eagle3Head, q, keys0, values0, step_keys, step_values, causal) -> torch.Tensor:
    """Step-k attention: causal scores against step-0 keys plus one diagonal score per later step.

    q [B,nh,T,hd]; keys0/values0 and each of step_keys/step_values [B,nkv,T,hd]; causal Bool [B,1,T,T].
    One softmax in fp32 over [step-0 keys | same-position keys of steps 1..k].
    """
    scale = head.config.head_dim ** -0.5
    keys0, values0 = head.repeat_kv(keys0), head.repeat_kv(values0)
    scores = (q @ keys0.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~causal, MASKED)
    diag = [(q.float() * head.repeat_kv(kj).float()).sum(-1, keepdim=True) * scale for kj in step_keys]
    probs = torch.cat([scores, *diag], dim=-1).softmax(-1)
    t = q.shape[2]
    out = probs[..., :t].to(values0.dtype) @ values0
    for j, vj in enumerate(step_values):
        out = out + probs[..., t + j: t + j + 1].to(vj.dtype) * head.repeat_kv(vj)
    return out


def teacher_rows(teacher, valids: list[torch.Tensor]):
    """Teacher probs and argmax at every position some step reads (t+k+1), once, plus a [B,T] row map."""
    needed = torch.zeros_like(valids[0])
    for k, valid in enumerate(valids):
        needed |= shift_right(valid, k + 1)
    b, t = needed.nonzero(as_tuple=True)
    logits = teacher.logits_at(b, t)
    row_of = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
    row_of[b, t] = torch.arange(b.numel(), device=needed.device)
    return logits.softmax(-1), logits.argmax(-1), row_of


def shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t-n] at t, False/0 before the start."""
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, : x.shape[1] - n]], dim=1)


def hidden_regression(head: Eagle3Head, hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Per-row squared error of the head's normed output against the target's final normed hidden state,
    relative to the latter's squared norm (so the term's scale is the same for every target).

    The draft's logits are lm_head(norm(h)) and the teacher's are its lm_head rows times that final hidden, so
    matching it matches every logit at once: a dense signal of H numbers per token where the distribution
    mostly speaks through its top tokens (EAGLE-1 trained its features this way)."""
    ref = teacher_hidden.float()
    return (head.norm(hidden).float() - ref).pow(2).sum(-1) / ref.pow(2).sum(-1).clamp_min(1e-6)


def ttt_loss(head: Eagle3Head, embed_weight: torch.Tensor, batch: dict, teacher,
             ttt_steps: int = 7, step_weight_decay: float = 0.8, loss: str = "kl",
             hidden_weight: float = 0.0) -> TTTResult:
    """The TTT loss of one batch (keys: input_ids, loss_mask, attention_mask, aux, target_in_draft).

    `teacher` has logits_at(b, t) -> [N, Vd]: the target's logits over the draft vocab at those positions.
    `hidden_weight` > 0 adds that times `hidden_regression` at every trained position (needs the batch's
    teacher_hidden: a last_hidden feature store or online features).
    """
    if hidden_weight > 0 and "teacher_hidden" not in batch:
        raise KeyError("train.hidden_loss_weight needs the target's final hidden states (collect.teacher="
                       "last_hidden); this batch has the top-k teacher only")
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    bsz, seq = ids.shape
    device = ids.device
    positions = torch.arange(seq, device=device).expand(bsz, seq)
    causal = (torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None] & attn[:, None, :])[:, None]

    hidden = head.fuse(batch["aux"])
    keys0 = values0 = None
    step_keys, step_values = [], []
    losses, correct, counts = [], [], []
    valids = [step_valid(batch, k) for k in range(ttt_steps)]
    probs_all, argmax_all, row_of = teacher_rows(teacher, valids)
    hits = []
    for k in range(ttt_steps):
        q, key, value, residual = head.qkv(hidden, embed(embed_weight, shift_left(ids, k + 1)), positions + k)
        if k == 0:
            keys0, values0 = key, value
        else:
            step_keys.append(key)
            step_values.append(value)
        hidden = head.finish(ttt_attention(head, q, keys0, values0, step_keys, step_values, causal), residual)

        # Logits only where the step is trained: the lm_head is the largest matmul of the head.
        b, t = valids[k].nonzero(as_tuple=True)
        draft_logits = head.logits(hidden[b, t])
        rows = row_of[b, t + k + 1]
        target_argmax = argmax_all[rows]
        ce = draft_loss(loss, draft_logits, probs_all[rows], target_argmax)
        if hidden_weight > 0:
            ce = ce + hidden_weight * hidden_regression(head, hidden[b, t], batch["teacher_hidden"][b, t + k + 1])
        losses.append(ce.sum() / max(ce.numel(), 1))
        hit = draft_logits.argmax(-1) == target_argmax
        correct.append(hit.sum())
        counts.append(torch.tensor(ce.numel(), device=device))

        hit_map = torch.zeros(bsz, seq, dtype=torch.bool, device=device)
        hit_map[b, t] = hit
        hits.append(hit_map)

    step_losses = torch.stack(losses)
    weights = step_weight_decay ** torch.arange(ttt_steps, device=device, dtype=torch.float32)
    accepted, n_positions = acceptance(torch.stack(hits), torch.stack(valids))
    return TTTResult(
        loss=(weights * step_losses).sum(),
        step_losses=step_losses.detach().float(),
        step_correct=torch.stack(correct),
        step_count=torch.stack(counts),
        accepted=accepted,
        positions=n_positions,
    )


def acceptance(hits: torch.Tensor, valids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(leading-correct steps summed, positions) over positions valid at every step; hits/valids Bool [K,B,T]."""
    full = valids.all(0)
    leading = hits.long().cumprod(0).sum(0)
    return (leading * full).sum(), full.sum()
