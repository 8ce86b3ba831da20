"""The bench's arithmetic: every figure of report.json from the per-prompt results of the decoders.

Acceptance is counted the way vLLM counts it (pooled over all requests); throughput is total tokens over
total wall time; latencies are percentiles with numpy's linear interpolation; speedups carry a bootstrap
interval over prompts; a cost model relates the measured speedup to what alpha and K predict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from eyas.eval.bench import BenchPrompt

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float], qs: Sequence[int] = PERCENTILES, scale: float = 1.0) -> dict:
    """{"p50": .., "p90": .., "p99": ..} with linear interpolation (numpy's default, as vLLM reports); None if empty."""
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def inter_token_latencies(token_times_s: Sequence[float]) -> list[float]:
    """Gaps between successive token arrivals. Tokens that a verify step accepts together arrive at the same
    time and count as one arrival, as in a streaming client (vLLM's benchmark measures ITL per chunk)."""
    arrivals = sorted(set(float(t) for t in token_times_s))
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def _pooled(lists: Sequence[Sequence[float]]) -> list[float]:
    """Element-wise sum of lists of different lengths."""
    out: list[float] = []
    for values in lists:
        for i, v in enumerate(values or []):
            if i == len(out):
                out.append(0)
            out[i] += v
    return out


def acceptance_figures(stats: Sequence[Any]) -> dict:
    """Draft acceptance pooled over prompts, as vLLM counts it.

    tau = 1 + accepted / drafts over all verify steps of all prompts (the mean of per-prompt means weights a
    short answer like a long one, so it is reported beside it only for comparison); alpha = accepted draft
    tokens / proposed draft tokens; alpha_per_position[i] = accepted at depth i / drafts that proposed depth
    i with every earlier draft token accepted (conditional acceptance).
    """
    drafts = sum(s.drafts for s in stats)
    draft_tokens = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    accepted_pos = _pooled([s.accepted_per_position for s in stats])
    reached_pos = _pooled([s.reached_per_position for s in stats])
    per_prompt_tau = [1 + s.accepted_tokens / s.drafts for s in stats if s.drafts]
    forwards = sum(s.target_forwards for s in stats)
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "tau": 1 + accepted / drafts if drafts else None,
        "tau_mean_of_prompts": float(np.mean(per_prompt_tau)) if per_prompt_tau else None,
        "alpha": accepted / draft_tokens if draft_tokens else None,
        "alpha_per_position": [a / r if r else None for a, r in zip(accepted_pos, reached_pos)],
        # vLLM's per-position acceptance rate: accepted at depth i / all drafts.
        "acceptance_rate_per_position": [a / drafts if drafts else None for a in accepted_pos],
        "accepted_per_position": accepted_pos,
        "reached_per_position": reached_pos,
        # SGLang's accept length: generated tokens per target forward (prefill included).
        "tokens_per_target_forward": sum(len(s.tokens) for s in stats) / forwards if forwards else None,
    }


def speed_figures(stats: Sequence[Any], wall_s: Sequence[float]) -> dict:
    """Throughput and latency of one decoder over prompts; wall times are measured around generate()."""
    tokens = sum(len(s.tokens) for s in stats)
    total_wall = float(sum(wall_s))
    itl = [gap for s in stats for gap in inter_token_latencies(s.token_times_s)]
    # Time per output token after the first, per prompt (vLLM's TPOT).
    tpot = [(w - s.ttft_s) / (len(s.tokens) - 1) for s, w in zip(stats, wall_s) if len(s.tokens) > 1]
    split = {part: float(sum(getattr(s, f"time_{part}_s") for s in stats)) for part in ("target", "draft", "other")}
    return {
        "prompts": len(stats),
        "new_tokens": tokens,
        "wall_s": total_wall,
        "tokens_per_s": tokens / total_wall if total_wall > 0 else None,
        "ttft_ms": percentiles([s.ttft_s for s in stats], scale=1e3),
        "itl_ms": percentiles(itl, scale=1e3),
        "tpot_ms": percentiles(tpot, scale=1e3),
        "target_forwards": int(sum(s.target_forwards for s in stats)),
        "time_s": split,
        "time_ms_per_token": {k: 1e3 * v / tokens if tokens else None for k, v in split.items()},
    }


def token_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Share of the reference tokens reproduced before the first divergence (1.0 = identical)."""
    if not reference and not other:
        return 1.0
    same = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        same += 1
    return same / max(len(reference), len(other))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def speedup_interval(spec_tokens: Sequence[int], spec_s: Sequence[float], plain_tokens: Sequence[int],
                     plain_s: Sequence[float], samples: int = 1000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of the speedup over prompts: how much the figure moves with the prompt sample."""
    n = len(spec_tokens)
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))
    st, ss, pt, ps = (np.asarray(x, dtype=np.float64)[idx].sum(1) for x in (spec_tokens, spec_s, plain_tokens, plain_s))
    ratios = (st / ss) / (pt / ps)
    ratios = ratios[np.isfinite(ratios)]
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))] if ratios.size else None


def predicted_speedup(alpha: float, k: int, verify_cost: float = 1.0, draft_cost: float = 0.0,
                      other_cost: float = 0.0, tokens_per_step: float | None = None) -> float | None:
    """Tokens per step over the cost of a step (one verify forward + K draft forwards + overhead), all costs
    relative to one plain decoding step. Without `tokens_per_step`, the classic estimate for a per-token
    acceptance probability alpha that is the same at every depth: (1 - alpha^(K+1)) / (1 - alpha)."""
    if tokens_per_step is None:
        tokens_per_step = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    cost = verify_cost + k * draft_cost + other_cost
    return tokens_per_step / cost if cost > 0 else None  # no measured cost: no prediction


def cost_model(plain: Sequence[Any], plain_wall: Sequence[float], chain: Sequence[Any], alpha: float | None,
               k: int) -> dict:
    """Measured step costs of the chain decoder relative to a plain step, and the speedup they predict.

    Prefill is taken out of both sides: its cost is the plain decoder's time to first token on the same
    prompt (identical computation), so what is compared is the per-step cost of the decode phase.
    """
    plain_steps = sum(max(s.target_forwards - 1, 0) for s in plain)
    plain_decode_s = sum(w - s.ttft_s for s, w in zip(plain, plain_wall))
    chain_steps = sum(max(s.target_forwards - 1, 0) for s in chain)
    if not plain_steps or not chain_steps or alpha is None or plain_decode_s <= 0:
        return {}
    plain_step = plain_decode_s / plain_steps
    verify_s = sum(c.time_target_s - min(p.ttft_s, c.time_target_s) for c, p in zip(chain, plain))
    draft_forwards = sum(c.draft_tokens for c in chain)  # a chain runs the head once per draft token
    verify_cost = verify_s / chain_steps / plain_step
    draft_cost = (sum(c.time_draft_s for c in chain) / draft_forwards / plain_step) if draft_forwards else 0.0
    other_cost = sum(c.time_other_s for c in chain) / chain_steps / plain_step
    # alpha is accepted / drafted over chain steps of K drafts, so a step yields 1 + K * alpha tokens on
    # average: measured, not the classic formula (acceptances at successive depths are far from independent).
    tokens = 1 + k * alpha
    return {
        "k": k,
        "alpha": alpha,
        "plain_step_ms": 1e3 * plain_step,
        "verify_cost": verify_cost,
        "draft_cost": draft_cost,
        "other_cost": other_cost,
        "expected_tokens_per_step": tokens,
        "predicted_speedup_free_draft": tokens,
        "predicted_speedup": predicted_speedup(alpha, k, verify_cost, draft_cost, other_cost, tokens_per_step=tokens),
        "predicted_speedup_independent": predicted_speedup(alpha, k, verify_cost, draft_cost, other_cost),
    }


# ---- one prompt, every decoder --------------------------------------------------------------------

@dataclass
class PromptResult:
    prompt: BenchPrompt
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # decoder name -> GenerationStats
    wall_s: dict[str, float] = field(default_factory=dict)  # runner name -> seconds around generate()
    hf_tokens: dict[str, list[int]] = field(default_factory=dict)  # hf runner name -> generated ids


def summarize(results: Sequence[PromptResult], greedy: bool, k_alpha: int) -> dict:
    """Every figure of the report for a set of prompts (all of them, or one category)."""
    plain = [r.stats["plain"] for r in results]
    spec = [r.stats["spec"] for r in results]
    chain = [r.stats["chain"] for r in results]
    plain_speed = speed_figures(plain, [r.wall_s["plain"] for r in results])
    spec_speed = speed_figures(spec, [r.wall_s["spec"] for r in results])
    main = acceptance_figures(spec)
    chain_acc = acceptance_figures(chain)
    out = {
        "prompts": len(results),
        "tau": main["tau"],
        "tau_mean_of_prompts": main["tau_mean_of_prompts"],
        "alpha": chain_acc["alpha"],
        "alpha_per_position": chain_acc["alpha_per_position"],
        "spec_tokens_per_s": spec_speed["tokens_per_s"],
        "baseline_tokens_per_s": plain_speed["tokens_per_s"],
        "speedup": ratio(spec_speed["tokens_per_s"], plain_speed["tokens_per_s"]),
        "speedup_ci95": speedup_interval([len(s.tokens) for s in spec], [r.wall_s["spec"] for r in results],
                                         [len(s.tokens) for s in plain], [r.wall_s["plain"] for r in results]),
        "ttft_ms": {"baseline": plain_speed["ttft_ms"], "spec": spec_speed["ttft_ms"]},
        "itl_ms": {"baseline": plain_speed["itl_ms"], "spec": spec_speed["itl_ms"]},
        "itl_p99_regression": ratio(spec_speed["itl_ms"]["p99"], plain_speed["itl_ms"]["p99"]) - 1
        if spec_speed["itl_ms"]["p99"] is not None and plain_speed["itl_ms"]["p99"] else None,
        "acceptance": main,
        "chain_acceptance": chain_acc,
        "baseline": plain_speed,
        "spec": spec_speed,
    }
    if any(r.stats["chain"] is not r.stats["spec"] for r in results):
        chain_speed = speed_figures(chain, [r.wall_s["chain"] for r in results])
        out["chain"] = chain_speed
        out["chain_speedup"] = ratio(chain_speed["tokens_per_s"], plain_speed["tokens_per_s"])
    else:
        out["chain_speedup"] = out["speedup"]
    out["cost_model"] = cost_model(plain, [r.wall_s["plain"] for r in results], chain, chain_acc["alpha"], k_alpha)
    for name in ("hf_generate", "prompt_lookup"):
        if all(name in r.wall_s for r in results) and results:
            tokens = sum(len(r.hf_tokens[name]) for r in results)
            wall = sum(r.wall_s[name] for r in results)
            out[f"{name}_tokens_per_s"] = tokens / wall if wall > 0 else None
            out[f"speedup_vs_{name}"] = ratio(spec_speed["tokens_per_s"], out[f"{name}_tokens_per_s"])
        else:
            out[f"{name}_tokens_per_s"] = None
            out[f"speedup_vs_{name}"] = None
    out.update(fastest_plain(out))
    out.update(lossless_figures(results, greedy))
    return out


def fastest_plain(out: dict) -> dict:
    """The fastest plain (non-speculative) decoder measured, and the speedup over it: the honest figure.

    eyas' plain decoder and transformers' generate() run through the same layers; whichever is faster on
    this machine is the baseline a user would otherwise have."""
    plain = {"eyas plain decoder": out["baseline_tokens_per_s"],
             "transformers generate()": out.get("hf_generate_tokens_per_s")}
    measured = {k: v for k, v in plain.items() if v}
    if not measured:
        return {"fastest_plain": None, "speedup_vs_fastest_plain": None}
    name = max(measured, key=measured.get)
    return {"fastest_plain": {"decoder": name, "tokens_per_s": measured[name]},
            "speedup_vs_fastest_plain": ratio(out["spec_tokens_per_s"], measured[name])}


def lossless_figures(results: Sequence[PromptResult], greedy: bool) -> dict:
    """Greedy speculative output must equal plain greedy output token for token (exact in fp32)."""
    if not greedy:
        return {"lossless": None, "lossless_note": "sampling (temperature > 0): outputs are not comparable "
                                                   "token by token"}
    spec_same = [r.stats["spec"].tokens == r.stats["plain"].tokens for r in results]
    chain_same = [r.stats["chain"].tokens == r.stats["plain"].tokens for r in results]
    agreement = [token_agreement(r.stats["plain"].tokens, r.stats["spec"].tokens) for r in results]
    out = {
        "lossless": all(spec_same) and all(chain_same),
        "lossless_prompts": sum(a and b for a, b in zip(spec_same, chain_same)),
        "token_agreement": float(np.mean(agreement)) if agreement else None,
    }
    hf = [token_agreement(r.stats["plain"].tokens, r.hf_tokens["hf_generate"]) for r in results
          if "hf_generate" in r.hf_tokens]
    out["hf_generate_token_agreement"] = float(np.mean(hf)) if hf else None
    return out


def by_category(results: Sequence[PromptResult], greedy: bool, k_alpha: int) -> dict:
    groups: dict[str, list[PromptResult]] = {}
    for r in results:
        groups.setdefault(r.prompt.category, []).append(r)
    return {name: summarize(group, greedy, k_alpha) for name, group in sorted(groups.items())}


def per_prompt_rows(results: Sequence[PromptResult], greedy: bool) -> list[dict]:
    rows = []
    for r in results:
        plain, spec = r.stats["plain"], r.stats["spec"]
        rows.append({
            "line": r.prompt.line,
            "category": r.prompt.category,
            "prompt_tokens": r.prompt_tokens,
            "baseline_tokens": len(plain.tokens),
            "spec_tokens": len(spec.tokens),
            "tau": 1 + spec.accepted_tokens / spec.drafts if spec.drafts else None,
            "lossless": spec.tokens == plain.tokens and r.stats["chain"].tokens == plain.tokens if greedy else None,
            "spec_finish_reason": spec.finish_reason,
            "baseline_tokens_per_s": len(plain.tokens) / r.wall_s["plain"] if r.wall_s["plain"] > 0 else None,
            "spec_tokens_per_s": len(spec.tokens) / r.wall_s["spec"] if r.wall_s["spec"] > 0 else None,
        })
    return rows

