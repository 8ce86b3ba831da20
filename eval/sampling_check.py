"""Does sampled speculative decoding draw from the target's own distribution? A statistical check.

On a target with a tiny vocabulary the exact joint distribution of the generated tokens 2 and 3 can be
enumerated (token 1 comes from the prefill alone; tokens 2 and 3 go through drafting and rejection
sampling). Samples from a decoder must sit within the sampling noise of that distribution, measured by
total variation against a threshold simulated from the exact distribution itself. Used by the test suite
and by the GPU check (benchmarks/gpu_check.py), so the same check runs on every device.
"""

from __future__ import annotations

import numpy as np
import torch

from eyas.eval import sampling


def exact_tokens_2_3(model, prompt: torch.Tensor, cfg, vocab: int) -> np.ndarray:
    """P(token2, token3) [V,V], marginalising token 1, from the target's warped distributions."""
    warp = lambda logits: sampling.warp_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p).double()  # noqa: E731
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab)).to(prompt.device)  # (x1, x2)
    with torch.no_grad():
        logits = model(torch.cat([prompt.expand(len(pairs), -1), pairs], 1)).logits.float()
    t = prompt.shape[1]
    p1 = warp(logits[0, t - 1])  # [V]
    p2 = warp(logits[:, t]).view(vocab, vocab, vocab)[:, 0]  # [x1, x2]: any x2 row sees only x1
    p3 = warp(logits[:, t + 1]).view(vocab, vocab, vocab)  # [x1, x2, x3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).cpu().numpy()


def sampled_tokens_2_3(decoder, prompt: torch.Tensor, n: int, vocab: int) -> np.ndarray:
    """The empirical P(token2, token3) of `n` generations of three tokens."""
    counts = np.zeros((vocab, vocab))
    for _ in range(n):
        tokens = decoder.generate(prompt).tokens
        counts[tokens[1], tokens[2]] += 1
    return counts / n


def null_tv_threshold(exact: np.ndarray, n: int, quantile: float = 0.999) -> float:
    """Total variation that an exact sampler exceeds with probability 1 - quantile at n samples."""
    rng = np.random.default_rng(0)
    p = exact.ravel() / exact.sum()
    draws = rng.multinomial(n, p, size=4000) / n
    return float(np.quantile(0.5 * np.abs(draws - p).sum(1), quantile))


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())
