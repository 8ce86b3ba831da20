"""The gate on the serving engine's own figures, and how they reach report.json and summary.md."""

import json

import pytest

from eyas.eval.config import GateConfig
from eyas.eval.engine_report import engine_summary
from eyas.eval.gate import evaluate, run_gate
from eyas.eval.report import load_report
from test_gate_checks import crafted_report, write_report


def engine_run(acceptance=0.6, speedups=(1.3, 1.1, 0.8), itl_ratio=1.2, by_category=None):
    """An engine run as eval/engine_bench.py returns it (only the fields engine_summary reads)."""
    levels = [{"concurrency": c, "speedup": s, "itl_p99_ratio": itl_ratio if c == 1 else 2.0}
              for c, s in zip((1, 2, 4), speedups)]
    return {"engine": "vllm", "engine_version": "0.32.0", "speculative_config": {"num_speculative_tokens": 3},
            "acceptance": {"acceptance_rate": acceptance, "mean_acceptance_length": 1 + 3 * acceptance,
                           "per_position": [0.8, 0.6, 0.4]},
            "by_category": by_category or {"chat": {"acceptance_rate": 0.7}, "code": {"acceptance_rate": 0.3}},
            "levels": levels, "speedup_c1": speedups[0], "break_even_concurrency": 4, "identical": 1.0}


def report_with_engine(tmp_path, parity=True, **run):
    report = crafted_report(engine=engine_summary(engine_run(**run), {"passed": parity}))
    return write_report(tmp_path, report)


def test_engine_figures_are_checked_with_the_same_bars_and_parity(tmp_path, capsys):
    path = report_with_engine(tmp_path)
    assert run_gate(path, GateConfig(min_alpha=0.55, min_speedup=1.0, max_itl_p99_regression=0.5)) == 0
    checks = {(c["name"], c["scope"]): c for c in json.loads((path.parent / "gate.json").read_text())["checks"]}
    assert checks[("alpha", "engine (vllm)")]["value"] == 0.6
    assert checks[("speedup", "engine (vllm)")]["value"] == 1.3
    assert checks[("itl_p99_regression", "engine (vllm)")]["value"] == pytest.approx(0.2)
    assert checks[("parity", "engine (vllm)")]["passed"] is True
    out = capsys.readouterr().out
    assert "engine: speculation stops paying at concurrency 4" in out
    assert json.loads((path.parent / "gate.json").read_text())["engine_break_even_concurrency"] == 4


@pytest.mark.parametrize("run, parity, failing", [
    ({"acceptance": 0.4}, True, ("alpha", "engine (vllm)")),          # the engine accepts less than the bar
    ({"speedups": (0.9, 0.8, 0.7)}, True, ("speedup", "engine (vllm)")),  # slower than plain serving
    ({}, False, ("parity", "engine (vllm)")),                          # engine and in-repo decoder disagree
])
def test_a_miss_on_the_engine_fails_the_gate(tmp_path, run, parity, failing):
    path = report_with_engine(tmp_path, parity=parity, **run)
    assert run_gate(path, GateConfig(min_alpha=0.55, min_speedup=1.0)) == 1
    failed = [(c["name"], c["scope"]) for c in json.loads((path.parent / "gate.json").read_text())["checks"]
              if not c["passed"]]
    assert failed == [failing]


def test_engine_acceptance_is_blended_by_traffic_weights(tmp_path):
    report = load_report(report_with_engine(tmp_path))
    gate = GateConfig(min_alpha=0.55, weights={"chat": 0.75, "code": 0.25})
    [engine_alpha] = [c for c in evaluate(report, gate) if c.name == "alpha" and c.scope.startswith("engine")]
    assert engine_alpha.value == pytest.approx(0.75 * 0.7 + 0.25 * 0.3) and engine_alpha.passed
    gate.weights = {"chat": 0.1, "code": 0.9}
    [engine_alpha] = [c for c in evaluate(report, gate) if c.name == "alpha" and c.scope.startswith("engine")]
    assert engine_alpha.value == pytest.approx(0.1 * 0.7 + 0.9 * 0.3) and not engine_alpha.passed


def test_summary_has_the_engine_section(tmp_path):
    from eyas.eval.report import engine_lines

    text = "\n".join(engine_lines(load_report(report_with_engine(tmp_path))["engine"]))
    assert text.startswith("## Through the serving engine")
    assert "acceptance rate 0.600" in text and "1: 1.30x, 2: 1.10x, 4: 0.80x" in text
    assert "stops paying at concurrency 4" in text and "parity with the in-repo decoder: yes" in text
    assert engine_lines(None) == []
    paid_everywhere = {**load_report(report_with_engine(tmp_path))["engine"], "break_even_concurrency": None}
    assert "; speculation paid at every concurrency measured;" in "\n".join(engine_lines(paid_everywhere))
