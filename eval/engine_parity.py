"""Engine parity: does the serving engine accept the head's drafts as the in-repo decoder does?

Same prompts, same chain length K, greedy. Per draft position, accepted-at-position / drafts on both
sides (vLLM's per-position acceptance; eval/aggregate.py `acceptance_figures` computes the same figure as
acceptance_rate_per_position). A broken export, a vocabulary or tokenizer mismatch or wrong aux layer ids
show up as the engine accepting far less than the in-repo decoder. docs/engine.md gives the test.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from eyas.eval.engine_bench import pyplot


def engine_parity(repo_per_position: Sequence[float], repo_drafts: int, engine_per_position: Sequence[float],
                  engine_drafts: int, alpha: float = 0.01, min_difference: float = 0.03) -> dict:
    """Do the in-repo decoder and the engine accept drafts alike, position by position (chain K)?

    Per position a two-proportion z-test of accepted/drafts (pooled standard error), Bonferroni-corrected
    over the positions (family-wise level `alpha`). A position fails when the difference is significant
    AND larger than `min_difference` (rounding in the engine's kernels moves acceptance a little; a
    broken export, a vocabulary mismatch or wrong aux layers move it a lot). Drafts are treated as
    independent trials, an approximation: drafts of one request are correlated, which makes the true
    spread wider than the test assumes, so it errs towards failing.
    """
    k = min(len(repo_per_position), len(engine_per_position))
    if k == 0 or not repo_drafts or not engine_drafts:
        return {"passed": False, "reason": "no drafts on one side", "rows": []}
    z_crit = _z_critical(alpha / k)
    rows = []
    for i in range(k):
        p1, p2 = float(repo_per_position[i]), float(engine_per_position[i])
        pooled = (p1 * repo_drafts + p2 * engine_drafts) / (repo_drafts + engine_drafts)
        se = math.sqrt(pooled * (1 - pooled) * (1 / repo_drafts + 1 / engine_drafts))
        z = (p2 - p1) / se if se > 0 else (0.0 if p1 == p2 else math.inf)
        ok = abs(z) <= z_crit or abs(p2 - p1) <= min_difference
        rows.append({"position": i, "repo": p1, "engine": p2, "difference": p2 - p1, "z": z, "ok": ok})
    return {"passed": all(r["ok"] for r in rows), "alpha": alpha, "z_critical": z_crit,
            "min_difference": min_difference, "repo_drafts": repo_drafts, "engine_drafts": engine_drafts,
            "rows": rows}


def parity_from_figures(repo: dict, engine: dict, **kw) -> dict:
    """`engine_parity` of the in-repo bench's chain acceptance (eval/aggregate.py `acceptance_figures`:
    acceptance_rate_per_position, drafts) against the engine's (`spec_figures`: per_position, drafts)."""
    return engine_parity(repo["acceptance_rate_per_position"], repo["drafts"], engine["per_position"] or [],
                         engine["drafts"], **kw)


def _z_critical(two_sided_alpha: float) -> float:
    """Standard-normal quantile 1 - alpha/2, by bisection on erfc (no scipy needed)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if math.erfc(mid / math.sqrt(2)) > two_sided_alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def parity_markdown(parity: dict) -> str:
    lines = [f"engine parity: {'PASS' if parity['passed'] else 'FAIL'}", "",
             "| position | in-repo | engine | difference | z | ok |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['position']} | {r['repo']:.3f} | {r['engine']:.3f} | {r['difference']:+.3f} | {r['z']:.2f} "
              f"| {'yes' if r['ok'] else 'NO'} |" for r in parity["rows"]]
    return "\n".join(lines) + "\n"


def plot_parity(parity: dict, path: Path) -> Path:
    plt = pyplot()
    rows = parity["rows"]
    xs = [r["position"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([x - 0.2 for x in xs], [r["repo"] for r in rows], width=0.4, label="in-repo decoder")
    ax.bar([x + 0.2 for x in xs], [r["engine"] for r in rows], width=0.4, label="engine")
    ax.set_xticks(xs)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.legend()
    ax.set_title(f"acceptance per position: parity {'PASS' if parity['passed'] else 'FAIL'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
