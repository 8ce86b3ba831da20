"""What a bench report looks like to a person: summary.md, a one-screen table, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from eyas.data.atomic import atomic_write as write_atomic


def write_json_atomic(path: str | Path, data: dict) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n"))


# ---- text -----------------------------------------------------------------------------------------

def fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def summary_rows(report: dict) -> list[tuple[str, str]]:
    itl, ttft = report["itl_ms"], report["ttft_ms"]
    return [
        ("prompts", str(report["prompts"])),
        ("tau (pooled, 1 + accepted/drafts)", fmt(report["tau"])),
        (f"alpha (chain K={report.get('alpha_chain_length')})", fmt(report["alpha"])),
        ("alpha per position", ", ".join(fmt(a, ".2f") for a in report["alpha_per_position"]) or "-"),
        ("baseline tokens/s", fmt(report["baseline_tokens_per_s"], ".1f")),
        ("speculative tokens/s", fmt(report["spec_tokens_per_s"], ".1f")),
        ("speedup vs plain decoding", fmt(report["speedup"], ".2f", "x") + (
            f" (95% CI over prompts {report['speedup_ci95'][0]:.2f}-{report['speedup_ci95'][1]:.2f}x)"
            if report.get("speedup_ci95") else "")),
        ("speedup vs HF generate()", fmt(report.get("speedup_vs_hf_generate"), ".2f", "x")),
        ("speedup vs prompt lookup", fmt(report.get("speedup_vs_prompt_lookup"), ".2f", "x")),
        ("predicted speedup (alpha, K, costs)", fmt(report.get("cost_model", {}).get("predicted_speedup"), ".2f", "x")),
        ("TTFT p50 ms (plain / spec)", f"{fmt(ttft['baseline']['p50'], '.1f')} / {fmt(ttft['spec']['p50'], '.1f')}"),
        ("ITL p50/p90/p99 ms plain", "/".join(fmt(itl["baseline"][p], ".1f") for p in ("p50", "p90", "p99"))),
        ("ITL p50/p90/p99 ms spec", "/".join(fmt(itl["spec"][p], ".1f") for p in ("p50", "p90", "p99"))),
        ("lossless", {True: "yes", False: "NO", None: "n/a"}[report["lossless"]]
         + (f" (token agreement {report['token_agreement']:.3f})" if report.get("token_agreement") is not None
            and not report["lossless"] else "")),
    ]


def category_table(report: dict) -> list[str]:
    lines = ["| category | prompts | tau | alpha | speedup | spec tok/s | plain tok/s | ITL p99 ms (plain/spec) "
             "| lossless |", "|---|---|---|---|---|---|---|---|---|"]
    for name, c in report["by_category"].items():
        lines.append(
            f"| {name} | {c['prompts']} | {fmt(c['tau'], '.2f')} | {fmt(c['alpha'], '.3f')} | "
            f"{fmt(c['speedup'], '.2f', 'x')} | {fmt(c['spec_tokens_per_s'], '.1f')} | "
            f"{fmt(c['baseline_tokens_per_s'], '.1f')} | {fmt(c['itl_ms']['baseline']['p99'], '.1f')} / "
            f"{fmt(c['itl_ms']['spec']['p99'], '.1f')} | {c['lossless']} |")
    return lines


def time_split_table(report: dict) -> list[str]:
    lines = ["| decoder | target ms/token | draft ms/token | other ms/token |", "|---|---|---|---|"]
    for name in ("baseline", "spec", "chain"):
        if name in report:
            t = report[name]["time_ms_per_token"]
            parts = " | ".join(fmt(t[part], ".2f") for part in ("target", "draft", "other"))
            lines.append(f"| {name} | {parts} |")
    return lines


def format_summary(report: dict) -> str:
    width = max(len(k) for k, _ in summary_rows(report))
    lines = [f"eyas bench: {report['head']['path']} on {report['target']['name']} "
             f"({report['environment']['device']}, {report['environment']['dtype']}, mode {report['decoder']['mode']})"]
    lines += [f"  {k:<{width}}  {v}" for k, v in summary_rows(report)]
    if len(report["by_category"]) > 1:
        lines.append("  per category:")
        lines += ["  " + line for line in category_table(report)]
    return "\n".join(lines)


def print_summary(report: dict) -> None:
    print(format_summary(report))


def write_summary(report: dict, path: str | Path) -> Path:
    cost = report.get("cost_model") or {}
    lines = [
        "# Speculative decoding benchmark", "",
        f"Head `{report['head']['path']}` (sha256 `{report['head']['sha256'][:16]}`) on target "
        f"`{report['target']['name']}` (sha256 `{report['target']['sha256'][:16]}`), "
        f"{report['environment']['device']} {report['environment']['dtype']}, decoder mode "
        f"`{report['decoder']['mode']}`, {report['prompts']} prompts, "
        f"max {report['decoder']['max_new_tokens']} new tokens, temperature {report['decoder']['temperature']}.",
        "",
        "| figure | value |", "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in summary_rows(report)]
    lines += ["", "## Per category", ""] + category_table(report)
    lines += ["", "## Where the time goes", ""] + time_split_table(report)
    if cost:
        lines += ["", f"Chain K={cost['k']}: a verify forward costs {cost['verify_cost']:.2f} plain steps, a draft "
                  f"forward {cost['draft_cost']:.3f}, other overhead {cost['other_cost']:.3f} per step. "
                  f"With alpha={cost['alpha']:.3f} a step yields {cost['expected_tokens_per_step']:.2f} tokens on "
                  f"average, so these costs predict {cost['predicted_speedup']:.2f}x "
                  f"(measured chain: {fmt(report.get('chain_speedup'), '.2f', 'x')}; with free drafting and verify "
                  f"as cheap as a plain step: {cost['predicted_speedup_free_draft']:.2f}x)."]
    lines += ["", f"Lossless: {report['lossless']}. {report.get('lossless_note', '')}", ""]
    lines += [f"![{p}]({p})" for p in report.get("plots", [])]
    text = "\n".join(lines) + "\n"
    return write_atomic(path, lambda tmp: tmp.write_text(text))


# ---- plots ----------------------------------------------------------------------------------------

def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png"))
    plt.close(fig)
    return path


def plot_acceptance(report: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    alphas = report["alpha_per_position"]
    rates = report["chain_acceptance"]["acceptance_rate_per_position"]
    depth = list(range(1, len(alphas) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([d - 0.2 for d in depth], [a or 0 for a in alphas], width=0.4, label="conditional (accepted / reached)")
    ax.bar([d + 0.2 for d in depth], [r or 0 for r in rates], width=0.4, label="accepted / drafts (vLLM)")
    ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), xticks=depth,
           title=f"Acceptance per draft position (chain K={report.get('alpha_chain_length')})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_categories(report: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    cats = report["by_category"]
    labels = [f"{n} (n={c['prompts']})" for n, c in cats.items()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.5))
    bars = left.bar(labels, [c["speedup"] or 0 for c in cats.values()], color="tab:green")
    left.bar_label(bars, fmt="%.2fx", fontsize=8)
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    left.set(title="speedup vs plain decoding", ylabel="x")
    bars = right.bar(labels, [c["alpha"] or 0 for c in cats.values()], color="tab:blue")
    right.bar_label(bars, fmt="%.2f", fontsize=8)
    right.set(title=f"alpha (chain K={report.get('alpha_chain_length')})", ylim=(0, 1))
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    return _save(fig, path)


def plot_speedup_model(report: dict, path: Path) -> Path:
    """Measured speedup beside what alpha predicts, and each decoder's time per token by part."""
    import matplotlib.pyplot as plt

    cost = report.get("cost_model") or {}
    bars = {"predicted:\nfree draft": cost.get("predicted_speedup_free_draft"),
            "predicted:\nmeasured cost": cost.get("predicted_speedup"),
            f"measured:\nchain K={cost.get('k', '-')}": report.get("chain_speedup"),
            f"measured:\n{report['decoder']['mode']}": report["speedup"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(list(bars), [v or 0 for v in bars.values()], color=["#bbb", "#888", "tab:orange", "tab:green"])
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    left.set(title=f"speedup: predicted from alpha={fmt(cost.get('alpha'), '.2f')}, K={cost.get('k', '-')} vs measured",
             ylabel="x plain decoding")
    left.title.set_fontsize(9)
    left.tick_params(axis="x", labelsize=8)
    decoders = [n for n in ("baseline", "spec", "chain") if n in report]
    bottom = [0.0] * len(decoders)
    for part, color in (("target", "tab:blue"), ("draft", "tab:orange"), ("other", "tab:gray")):
        values = [report[n]["time_ms_per_token"][part] or 0 for n in decoders]
        right.bar(decoders, values, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set(title="time per generated token by part", ylabel="ms / token")
    right.legend(fontsize=8)
    return _save(fig, path)


def write_plots(report: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out_dir)
    return [plot_acceptance(report, out_dir / "acceptance_per_position.png"),
            plot_categories(report, out_dir / "categories.png"),
            plot_speedup_model(report, out_dir / "speedup_model.png")]
