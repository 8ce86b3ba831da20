"""`eyas gate`: pass or fail a bench report against release thresholds; `eyas push` trusts only a pass.

Checks (a threshold left unset is skipped): alpha >= min_alpha, speedup >= min_speedup, p99 inter-token
latency regression (spec p99 ITL / plain p99 ITL - 1) <= max_itl_p99_regression, and, where the report
says exactness is expected (fp32 greedy), lossless output; a report measured on other target weights than
the head was trained against (`eyas bench` allowed to) always fails. Figures are pooled over all prompts, or blended
over categories with traffic weights (every weighted category must be in the report), or checked in every
category (`gate.per_category`). The verdict goes to gate.json beside the report, tied to the head's content
hash and to the report's own hash, so a later edit of either voids it.

Thresholds come as a GateConfig: the CLI lays its flags over the recipe's gate section (weights given as
a string go through `parse_weights`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.data.atomic import atomic_write_json
from eyas.data.packages import sha256_file
from eyas.eval.config import GateConfig
from eyas.eval.report import ReportError, load_report, stops_paying

GATE_FILE = "gate.json"


class GateError(ValueError):
    """Traffic weights the gate cannot use (not category=weight, negative, summing to 0)."""


@dataclass
class Check:
    name: str  # alpha | speedup | itl_p99_regression | lossless | category | target | parity
    scope: str  # pooled | blended | <category>
    value: float | bool | None
    threshold: str
    passed: bool


def parse_weights(weights: str | dict | None) -> dict[str, float]:
    """"chat=0.7,code=0.3" or {"chat": 0.7, "code": 0.3} -> {category: weight}; weights need not sum to 1."""
    if not weights:
        return {}
    if isinstance(weights, str):
        pairs = {}
        for item in weights.split(","):
            if not item.strip():
                continue
            name, sep, raw = item.partition("=")
            if not sep or not name.strip():
                raise GateError(f"weights: '{item.strip()}' is not category=weight (e.g. chat=0.7,code=0.3)")
            try:
                pairs[name.strip()] = float(raw)
            except ValueError:
                raise GateError(f"weights: '{raw.strip()}' for category '{name.strip()}' is not a number") from None
        weights = pairs
    out = {}
    for name, w in dict(weights).items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0:
            raise GateError(f"weights: category '{name}' has weight {w!r}; weights are numbers >= 0")
        out[str(name)] = float(w)
    if out and sum(out.values()) <= 0:
        raise GateError(f"weights: {out} sum to 0")
    return out


def blend(report: dict, weights: dict[str, float]) -> dict:
    """Figures for a traffic mix of categories.

    weights are shares of generated tokens: speedup = baseline time per token / spec time per token over
    the mix; alpha and the ITL regression are weighted means. Uses only the weighted categories present.
    """
    cats = report.get("by_category") or {}
    present = {c: w for c, w in weights.items() if c in cats and w > 0}
    if not present:
        return {"alpha": None, "speedup": None, "itl_p99_regression": None}

    def mean(key):
        values = [(w, cats[c].get(key)) for c, w in present.items()]
        if any(v is None for _, v in values):
            return None
        return sum(w * v for w, v in values) / sum(w for w, _ in values)

    base_time = spec_time = 0.0
    for c, w in present.items():
        base_tps, speedup = cats[c].get("baseline_tokens_per_s"), cats[c].get("speedup")
        if not base_tps or not speedup:
            base_time = None
            break
        base_time += w / base_tps
        spec_time += w / (base_tps * speedup)
    return {"alpha": mean("alpha"), "itl_p99_regression": mean("itl_p99_regression"),
            "speedup": base_time / spec_time if base_time else None}


def threshold_checks(figures: dict, scope: str, gate: GateConfig) -> list[Check]:
    rules = [("alpha", gate.min_alpha, ">="), ("speedup", gate.min_speedup, ">="),
             ("itl_p99_regression", gate.max_itl_p99_regression, "<=")]
    checks = []
    for name, limit, op in rules:
        if limit is None:
            continue
        value = figures.get(name)
        if name == "speedup" and figures.get("speedup_vs_fastest_plain") is not None:
            value = min(value, figures["speedup_vs_fastest_plain"]) if value is not None else None  # honest bar
        passed = value is not None and (value >= limit if op == ">=" else value <= limit)
        checks.append(Check(name, scope, value, f"{op} {limit:g}", passed))
    return checks


def engine_checks(engine: dict, gate: GateConfig) -> list[Check]:
    """The same bars on the serving engine's own counters and timings (`eyas bench --engine`): acceptance
    (blended by traffic weights when set), speedup and p99 ITL at concurrency 1, and parity with the
    in-repo decoder, whose failure is what a broken export or a vocabulary mismatch looks like."""
    scope = f"engine ({engine['engine']})"
    acceptance = engine["acceptance_rate"]
    if gate.weights:
        cats = engine.get("by_category") or {}
        present = {c: w for c, w in gate.weights.items() if c in cats and w > 0}
        acceptance = (sum(w * cats[c]["acceptance_rate"] for c, w in present.items()) / sum(present.values())
                      if present and all(cats[c]["acceptance_rate"] is not None for c in present) else None)
    figures = {"alpha": acceptance, "speedup": engine["speedup_c1"],
               "itl_p99_regression": engine["itl_p99_regression_c1"]}
    checks = threshold_checks(figures, scope + (" blended" if gate.weights else ""), gate)
    checks.append(Check("parity", scope, "agrees" if engine["parity_passed"] else "differs",
                        "in-repo acceptance per position", bool(engine["parity_passed"])))
    return checks


def evaluate(report: dict, gate: GateConfig) -> list[Check]:
    """The checks of a report (as load_report returns it) against `gate`, whose weights are parsed."""
    checks: list[Check] = []
    if gate.weights:
        for category in sorted(gate.weights):
            present = category in report["by_category"]
            checks.append(Check("category", category, "present" if present else "missing",
                                "measured in the report", present))
        checks += threshold_checks(blend(report, gate.weights), "blended", gate)
    else:
        checks += threshold_checks(report, "pooled", gate)
    if gate.per_category:
        for category, figures in sorted(report["by_category"].items()):
            checks += threshold_checks(figures, category, gate)
    if report.get("engine"):
        checks += engine_checks(report["engine"], gate)
    if report["target"]["matches_head"] is False:  # bench was allowed to measure on other weights
        checks.append(Check("target", "pooled", "other weights", "the head's own target weights", False))
    if report.get("lossless_exact_expected"):
        checks.append(Check("lossless", "pooled", report.get("lossless"), "== True (fp32 greedy)",
                            report.get("lossless") is True))
    return checks


def format_checks(checks: list[Check], report_path: Path, head_hash: str, engine: dict | None = None) -> str:
    def show(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [("check", "scope", "value", "threshold", "result")]
    rows += [(c.name, c.scope, show(c.value), c.threshold, "PASS" if c.passed else "FAIL") for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"eyas gate: {report_path} (head sha256 {head_hash[:16]})"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    if not checks:
        lines.append("verdict: FAIL (no threshold is set, so nothing was verified; set gate.min_alpha or a flag)")
        return "\n".join(lines)
    verdict = all(c.passed for c in checks)
    lines.append(f"verdict: {'PASS' if verdict else 'FAIL'} ({sum(not c.passed for c in checks)} of {len(checks)} "
                 "checks failed)")
    if engine:
        lines.append(f"engine: {stops_paying(engine.get('break_even_concurrency'))}")
    return "\n".join(lines)


def run_gate(report_path: str | Path, gate: GateConfig) -> int:
    """Print a table of checks, write gate.json next to the report, and return 1 if any check failed."""
    report_path = Path(report_path)
    report = load_report(report_path)
    gate = dataclasses.replace(gate, weights=parse_weights(gate.weights))
    checks = evaluate(report, gate)
    head_hash = report["head"]["sha256"]
    passed = bool(checks) and all(c.passed for c in checks)
    print(format_checks(checks, report_path, head_hash, report.get("engine")))
    atomic_write_json(report_path.with_name(GATE_FILE), {
        "passed": passed,
        "head_sha256": head_hash,
        "head_path": report["head"]["path"],
        "report": str(report_path.resolve()),
        "report_sha256": sha256_file(report_path),
        "thresholds": dataclasses.asdict(gate),
        "checks": [dataclasses.asdict(c) for c in checks],
        "engine_break_even_concurrency": (report.get("engine") or {}).get("break_even_concurrency"),
        "created_unix": time.time(),
    })
    return 0 if passed else 1


def gate_passed_for(head_hash: str, report_path) -> bool:
    """True only if gate.json beside the report passed, for this exact head content and this exact report."""
    report_path = Path(report_path)
    gate_file = report_path.with_name(GATE_FILE)
    try:
        verdict = json.loads(gate_file.read_text())
        report = load_report(report_path)
    except (OSError, json.JSONDecodeError, ReportError):
        return False
    return (verdict.get("passed") is True
            and bool(head_hash)
            and verdict.get("head_sha256") == head_hash
            and report["head"]["sha256"] == head_hash
            and verdict.get("report_sha256") == sha256_file(report_path))
