"""report.json, the one file bench writes and gate, export and the model card read, and how it looks to a person.

The schema is versioned: `schema_version` is REPORT_SCHEMA_VERSION, and `load_report` refuses a report
of another version or one missing a field the readers rely on, naming that field. Readers get reports
only through `load_report` (or `serving_settings`, for the export's snippets); bench builds one with
`make_report` and writes it with `write_report`. Beside it bench writes summary.md and PNG plots.

Fields every reader may rely on (bench writes many more: latencies, cost model, per prompt rows):
    schema_version        REPORT_SCHEMA_VERSION
    prompts, tau, alpha, speedup, spec_tokens_per_s, baseline_tokens_per_s, itl_p99_regression, lossless
                          the pooled figures; the same under by_category[<category>]
    alpha_per_position, alpha_chain_length (K at which alpha is measured), lossless_exact_expected
    decoder               mode, num_speculative_tokens, depth, topk, budget (the shape that was measured)
    head                  path, sha256 (content hash of its model.safetensors)
    target                name, sha256, matches_head (the head's recorded target hash is this target's;
                          null when the head records none; false only when bench was allowed to go on)
    environment           device, dtype
    noise                 trustworthy (false: load or run-to-run spread make the timings doubtful; null:
                          unknown), warnings (one line each); bench also records cpus, other_cpu_per_core (CPU
                          time of other processes during the bench), load_after and plain_ms_per_token_cv

Version 1 reports (before `noise` and `target.matches_head`) still load: both are filled in as unknown.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

from eyas.data.atomic import atomic_write, atomic_write_json, atomic_write_text

REPORT_SCHEMA_VERSION = 2
REPORT_FILE = "report.json"


class ReportError(ValueError):
    """A file that is not a bench report this eyas can read; the message names the field."""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


KINDS: dict[str, Callable[[Any], bool]] = {
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number or null": lambda v: v is None or _number(v),
    "true, false or null": lambda v: v is None or isinstance(v, bool),
    "true or false": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "a list": lambda v: isinstance(v, list),
    "an object": lambda v: isinstance(v, dict),
}
# The figures gate and model card read, pooled and per category.
FIGURES = {"prompts": "an integer", "tau": "a number or null", "alpha": "a number or null",
           "speedup": "a number or null", "spec_tokens_per_s": "a number or null",
           "baseline_tokens_per_s": "a number or null", "itl_p99_regression": "a number or null",
           "lossless": "true, false or null"}
FIELDS = {"schema_version": "an integer", **FIGURES, "alpha_per_position": "a list",
          "alpha_chain_length": "an integer", "lossless_exact_expected": "true or false",
          "by_category": "an object", "decoder": "an object", "head": "an object", "target": "an object",
          "environment": "an object", "noise": "an object"}
SECTIONS = {
    "decoder": {"mode": "a string", "num_speculative_tokens": "an integer", "depth": "an integer",
                "topk": "an integer", "budget": "an integer"},
    "head": {"path": "a string", "sha256": "a string"},
    "target": {"name": "a string", "sha256": "a string", "matches_head": "true, false or null"},
    "environment": {"device": "a string", "dtype": "a string"},
    "noise": {"trustworthy": "true, false or null", "warnings": "a list"},
}


def _check_fields(where: str, record: dict, fields: dict[str, str], prefix: str = "") -> None:
    for key, kind in fields.items():
        if key not in record:
            raise ReportError(f"{where}: field '{prefix}{key}' is missing (re-run `eyas bench`)")
        if not KINDS[kind](record[key]):
            raise ReportError(f"{where}: field '{prefix}{key}' is {record[key]!r:.40}, expected {kind}")


def check_report(report: Any, where: str = "bench report") -> None:
    """Raise ReportError naming the first field that is missing, of the wrong kind or of another version."""
    if not isinstance(report, dict):
        raise ReportError(f"{where}: expected a JSON object, got {type(report).__name__}")
    version = report.get("schema_version")
    if version is None:
        raise ReportError(f"{where}: field 'schema_version' is missing: not a report.json of `eyas bench`, or "
                          "one written before reports were versioned (re-run `eyas bench`)")
    if version != REPORT_SCHEMA_VERSION:
        raise ReportError(f"{where}: field 'schema_version' is {version!r}, this eyas reads version "
                          f"{REPORT_SCHEMA_VERSION} (and version 1, upgraded on load; re-run `eyas bench`)")
    _check_fields(where, report, FIELDS)
    for section, fields in SECTIONS.items():
        _check_fields(where, report[section], fields, prefix=f"{section}.")
    for name, figures in report["by_category"].items():
        if not isinstance(figures, dict):
            raise ReportError(f"{where}: field 'by_category.{name}' is {figures!r:.40}, expected an object")
        _check_fields(where, figures, FIGURES, prefix=f"by_category.{name}.")


def make_report(fields: dict) -> dict:
    """The report of `fields` (plain JSON values, stamped with the schema version), checked against the schema."""
    report = plain_json({"schema_version": REPORT_SCHEMA_VERSION, **fields})
    check_report(report)
    return report


def write_report(path: str | Path, report: dict) -> Path:
    check_report(report, str(path))
    return atomic_write_json(path, report)


def load_report(path: str | Path) -> dict:
    """A bench report.json, checked: FileNotFoundError when absent, ReportError naming a bad field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"bench report {path} does not exist (run `eyas bench <recipe>` first)")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    check_report(upgrade(report), str(path))
    return report


def upgrade(report: Any) -> Any:
    """A version 1 report as version 2: its machine load and whether its target was the head's are unknown."""
    if isinstance(report, dict) and report.get("schema_version") == 1:
        report["schema_version"] = REPORT_SCHEMA_VERSION
        report.setdefault("noise", {"trustworthy": None, "warnings": [
            "measured before eyas recorded machine load and run-to-run spread (report schema 1)"]})
        if isinstance(report.get("target"), dict):
            report["target"].setdefault("matches_head", None)
    return report


def serving_settings(report_path: str | Path | None, num_speculative_tokens: int | None = None) -> dict:
    """The decoding settings the export's serving snippets need, from the bench report when it exists.

    K is the report's alpha_chain_length (the chain length measured for serving) unless
    `num_speculative_tokens` overrides it; a tree decoder's depth, topk and budget carry over to
    SGLang's flags. Without a report file: chain defaults (heads.serving.decoding_settings).
    """
    from eyas.heads.serving import decoding_settings

    path = Path(report_path) if report_path else None
    if path is None or not path.exists():
        return decoding_settings(num_speculative_tokens)
    report = load_report(path)
    d = report["decoder"]
    return decoding_settings(num_speculative_tokens or report["alpha_chain_length"], mode=d["mode"],
                             depth=d["depth"], topk=d["topk"], budget=d["budget"], report=str(path.resolve()))


def plain_json(value):
    """Plain JSON values: numpy and torch scalars unwrapped, NaN/inf as null (JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_json(dataclasses.asdict(value))
    if hasattr(value, "tolist") and not isinstance(value, (bool, int, float, str)):
        return plain_json(value.tolist())  # numpy scalars and arrays, torch tensors (neither is imported here)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ---- text -----------------------------------------------------------------------------------------

def fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def warning_lines(report: dict) -> list[str]:
    """What makes the figures not the head's on its target, or doubtful (markdown lines): said first in every
    summary."""
    lines, target, noise = [], report["target"], report["noise"]
    if target["matches_head"] is False:
        lines += [f"**WARNING: measured on other weights than the head was trained against** (this target "
                  f"{target['sha256'][:12]}, the head's {str(target.get('head_target_sha256'))[:12]}): acceptance "
                  "and speedup are not the head's on its own target.", ""]
    if noise["trustworthy"] is False:
        lines += ["**WARNING: these figures are untrustworthy:**", ""] + [f"- {w}" for w in noise["warnings"]] + [""]
    return lines


def machine_line(report: dict) -> str:
    noise = report["noise"]
    load = "CPU use of other processes unknown" if noise.get("other_cpu_per_core") is None else (
        f"other processes used {noise['other_cpu_per_core']:.2f} of each CPU during the bench")
    return (f"{noise.get('cpus', '?')} CPUs, {load}; plain "
            f"decoding's ms/token varied {fmt(noise.get('plain_ms_per_token_cv'), '.1%')} across prompts (CV).")


def summary_rows(report: dict) -> list[tuple[str, str]]:
    itl, ttft = report["itl_ms"], report["ttft_ms"]
    doubtful = " UNTRUSTWORTHY (see warnings)" if report["noise"]["trustworthy"] is False else ""
    return [
        ("prompts", str(report["prompts"])),
        ("tau (pooled, 1 + accepted/drafts)", fmt(report["tau"])),
        (f"alpha (chain K={report.get('alpha_chain_length')})", fmt(report["alpha"])),
        ("alpha per position", ", ".join(fmt(a, ".2f") for a in report["alpha_per_position"]) or "-"),
        ("baseline tokens/s", fmt(report["baseline_tokens_per_s"], ".1f")),
        ("speculative tokens/s", fmt(report["spec_tokens_per_s"], ".1f")),
        ("speedup vs plain decoding", fmt(report["speedup"], ".2f", "x") + (
            f" (95% CI over prompts {report['speedup_ci95'][0]:.2f}-{report['speedup_ci95'][1]:.2f}x)"
            if report.get("speedup_ci95") else "") + doubtful),
        ("speedup vs the fastest plain decoding" + (f" ({report['fastest_plain']['decoder']})"
                                                    if report.get("fastest_plain") else ""),
         fmt(report.get("speedup_vs_fastest_plain"), ".2f", "x")),
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
    lines += [f"  {w.replace('**', '')}" for w in warning_lines(report) if w]
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
    ]
    lines += warning_lines(report)
    lines += ["| figure | value |", "|---|---|"]
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
    lines += engine_lines(report.get("engine"))
    lines += ["## Machine", "", machine_line(report), ""]
    lines += [f"![{p}]({p})" for p in report.get("plots", [])]
    return atomic_write_text(path, "\n".join(lines) + "\n")


def stops_paying(level: int | None) -> str:
    """engine_bench's break_even_concurrency in words, for every report that prints it."""
    if level is None:
        return "speculation paid at every concurrency measured"
    return f"speculation stops paying at concurrency {level} (the lowest level measured with speedup < 1)"


def engine_lines(engine: dict | None) -> list[str]:
    """The serving engine's figures (`eyas bench --engine`), when measured; engine/engine.md has them all."""
    if not engine:
        return []
    speedups = ", ".join(f"{c}: {fmt(v, '.2f', 'x')}" for c, v in engine["speedup_by_concurrency"].items())
    return ["## Through the serving engine", "",
            f"{engine['engine']} {engine.get('engine_version') or ''}, K={engine['num_speculative_tokens']}: "
            f"acceptance rate {fmt(engine['acceptance_rate'])} (per position "
            f"{', '.join(fmt(a, '.2f') for a in engine['acceptance_per_position'])}), mean acceptance length "
            f"{fmt(engine['mean_acceptance_length'], '.2f')}; speedup by concurrency {speedups}; "
            f"{stops_paying(engine['break_even_concurrency'])}; outputs identical to the engine without "
            f"speculation: {fmt(engine['identical'], '.0%')}; parity with the in-repo decoder: "
            f"{'yes' if engine['parity_passed'] else 'NO'}. Details: engine/engine.md, engine/parity.png.", ""]


# ---- plots ----------------------------------------------------------------------------------------

def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png"))
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
