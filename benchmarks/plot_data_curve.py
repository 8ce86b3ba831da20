"""The data curve as a picture: acceptance against the answer tokens a head trained on, from bench_methods results.

    python benchmarks/plot_data_curve.py runs/bm-a/baseline/method.json runs/bm-b/baseline/method.json \\
        --out docs/data-curve.png --targets 0.25,0.40,0.55

Each method.json (benchmarks/bench_methods.py) is one point: its `data` field gives the answer tokens of the
train split and the passes its steps made over them, its `acceptance` the measured rate. Points are grouped by
passes (rounded), since more passes over the same answers also raise acceptance; a group with two or more
sizes gets a least-squares line of acceptance on ln(answer tokens). The line's slope (acceptance gained per
e-fold of answers) and the answer tokens it puts at each --targets bar are printed: an extrapolation from a few
points, and labelled so on the plot. Pass points measured on the same prompts with the same method, or the line
mixes more than the data.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def load_point(path: Path) -> dict:
    """One point from a method.json; a file that cannot give one is named with the field it lacks."""
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not a readable method.json ({e})") from None
    for field, inner, why in (("data", ("answer_tokens", "passes"),
                               "written by bench_methods before it recorded the data it trained on; rerun the variant"),
                              ("acceptance", ("alpha",), "not a finished bench_methods result")):
        missing = [k for k in inner if k not in result.get(field, {})]
        if missing:
            raise SystemExit(f"{path}: no {field}.{missing[0]} ({why})")
    return {"label": result.get("variant", path.parent.name), "tokens": result["data"]["answer_tokens"],
            "passes": result["data"]["passes"], "alpha": result["acceptance"]["alpha"]}


def fit_log_linear(tokens: list[float], alphas: list[float]) -> tuple[float, float]:
    """Least squares alpha = slope * ln(tokens) + intercept; (slope, intercept)."""
    xs = [math.log(t) for t in tokens]
    mx, my = sum(xs) / len(xs), sum(alphas) / len(alphas)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs two different data sizes")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, alphas)) / sxx
    return slope, my - slope * mx


def tokens_at(alpha: float, slope: float, intercept: float) -> float:
    """The answer tokens the fitted line reaches `alpha` at (inf when it does not rise)."""
    return math.exp((alpha - intercept) / slope) if slope > 0 else math.inf


def curves(points: list[dict]) -> dict[int, dict]:
    """Points grouped by rounded passes, each group sorted by size, with its fit where it has two sizes."""
    groups: dict[int, dict] = {}
    for p in points:
        groups.setdefault(round(p["passes"]), {"points": []})["points"].append(p)
    for g in groups.values():
        g["points"].sort(key=lambda p: p["tokens"])
        if len({p["tokens"] for p in g["points"]}) >= 2:
            g["fit"] = fit_log_linear([p["tokens"] for p in g["points"]], [p["alpha"] for p in g["points"]])
    return groups


def plot(groups: dict[int, dict], targets: list[float], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eyas.data.atomic import atomic_write

    fig, ax = plt.subplots(figsize=(8, 5))
    for passes, g in sorted(groups.items()):
        xs, ys = [p["tokens"] for p in g["points"]], [p["alpha"] for p in g["points"]]
        line = ax.plot(xs, ys, marker="o", label=f"{passes} pass{'es' if passes != 1 else ''} over the answers")[0]
        for p in g["points"]:
            ax.annotate(f"{p['alpha']:.3f}", (p["tokens"], p["alpha"]), textcoords="offset points", xytext=(4, -12),
                        fontsize=8)
        if "fit" in g:
            slope, intercept = g["fit"]
            x_end = xs[-1] * 4
            ax.plot([xs[-1], x_end], [slope * math.log(x) + intercept for x in (xs[-1], x_end)], linestyle=":",
                    color=line.get_color(), label=f"fit: {slope:+.3f} per e-fold (extrapolated)")
    for bar in targets:
        ax.axhline(bar, color="grey", linewidth=0.8, linestyle="--")
        ax.text(0.99, bar, f"target {bar:.2f}", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set(title="acceptance (K=3) against answer tokens trained on", xlabel="answer tokens in the train split",
           ylabel="acceptance (accepted / drafted)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    return out


def report(groups: dict[int, dict], targets: list[float]) -> str:
    lines = ["| passes | answer tokens | acceptance | variant |", "|---:|---:|---:|---|"]
    for passes, g in sorted(groups.items()):
        lines += [f"| {passes} | {p['tokens']:,} | {p['alpha']:.3f} | {p['label']} |" for p in g["points"]]
    for passes, g in sorted(groups.items()):
        if "fit" not in g:
            continue
        slope, intercept = g["fit"]
        largest = g["points"][-1]["tokens"]
        reach = ", ".join(f"{bar:.2f} at ~{tokens_at(bar, slope, intercept) / largest:,.0f}x the largest"
                          for bar in targets)
        lines.append(f"\n{passes} passes: {slope:+.4f} acceptance per e-fold of answers"
                     + (f"; the line reaches {reach} ({largest:,} answer tokens)" if targets else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="method.json files of bench_methods")
    ap.add_argument("--out", type=Path, default=Path("data-curve.png"))
    ap.add_argument("--targets", default="", help="acceptance bars to draw and extrapolate to, e.g. 0.25,0.40")
    args = ap.parse_args(argv)
    try:
        targets = [float(t) for t in args.targets.split(",") if t]
    except ValueError:
        ap.error(f"--targets {args.targets!r}: acceptance bars are numbers separated by commas, e.g. 0.25,0.40")
    groups = curves([load_point(p) for p in args.results])
    print(report(groups, targets))
    print(f"wrote {plot(groups, targets, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
