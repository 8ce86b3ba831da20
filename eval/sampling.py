"""Token sampling and lossless verification of draft tokens (greedy and rejection sampling).

Rejection sampling keeps the target's distribution exactly: a draft token x proposed from q is accepted
with probability min(1, p(x)/q(x)); on rejection the next candidate (a sibling in a tree) is tested
against the residual norm(max(p - q, 0)); when every candidate is rejected, a token is drawn from the
last residual. A token chosen deterministically (top-k of the draft, as tree children are) is a proposal
with q = one-hot, so its test is "accept with p(x)" and its residual is p with x removed: siblings are
thereby tested without replacement.
"""

from __future__ import annotations

import torch


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Float32 sampling probabilities over the last dim after temperature, top-k and top-p filtering."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What is left of p after a rejected proposal from q: norm(max(p - q, 0))."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    # p == q leaves nothing: any rejected draw is then impossible, keep p to stay well defined.
    return r / total if total > 0 else p


def verify_node(p: torch.Tensor, candidates: list[int], proposals: list[torch.Tensor | None],
                generator: torch.Generator | None) -> tuple[int, int]:
    """Recursive rejection sampling at one node of the draft tree.

    p: the target's warped probabilities [V] at this node; candidates: the children's token ids in order;
    proposals: each child's proposal distribution over the target vocabulary, or None when the child was
    chosen deterministically (one-hot proposal). Returns (index of the accepted child or -1, the token):
    the accepted child's token, or a draw from the final residual when all were rejected.
    """
    for i, (token, q) in enumerate(zip(candidates, proposals)):
        u = torch.rand((), generator=generator).item()
        if q is None:
            if u < p[token].item():
                return i, token
            one_hot = torch.zeros_like(p)
            one_hot[token] = 1.0
            p = residual(p, one_hot)
        else:
            ratio = p[token].item() / max(q[token].item(), 1e-20)
            if u < ratio:
                return i, token
            p = residual(p, q)
    return -1, int(torch.multinomial(p, 1, generator=generator).item())
