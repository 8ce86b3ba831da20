"""The release gate on crafted reports: thresholds, blended traffic weights, exit code and gate.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.eval.config import GateConfig
from eyas.eval.gate import GateError, blend, gate_passed_for, parse_weights, resolve_thresholds, run_gate

HEAD = "ab" * 32


def category(alpha, speedup, base_tps, itl_reg):
    return {"alpha": alpha, "speedup": speedup, "baseline_tokens_per_s": base_tps,
            "spec_tokens_per_s": base_tps * speedup, "itl_p99_regression": itl_reg}


def crafted_report(**overrides) -> dict:
    report = {
        "alpha": 0.6, "speedup": 1.5, "itl_p99_regression": 0.2, "lossless": True,
        "lossless_exact_expected": True,
        "by_category": {"chat": category(0.7, 2.0, 100.0, 0.1), "code": category(0.4, 1.1, 50.0, 0.5)},
        "head": {"path": "/heads/best", "sha256": HEAD},
    }
    report.update(overrides)
    return report


def write_report(tmp_path: Path, report: dict) -> Path:
    path = tmp_path / "bench" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return path


def test_default_min_alpha_passes_and_writes_a_verdict_for_this_head(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path) == 0
    verdict = json.loads((path.parent / "gate.json").read_text())
    assert verdict["passed"] is True and verdict["head_sha256"] == HEAD
    assert [c["name"] for c in verdict["checks"]] == ["alpha", "lossless"]
    assert verdict["thresholds"]["min_alpha"] == 0.55
    out = capsys.readouterr().out
    assert "alpha" in out and ">= 0.55" in out and "verdict: PASS" in out


def test_each_threshold_can_fail_and_the_exit_code_is_1(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path, min_alpha=0.61) == 1
    assert run_gate(path, min_speedup=1.6) == 1
    assert run_gate(path, max_itl_p99_regression=0.19) == 1
    assert run_gate(path, min_alpha=0.6, min_speedup=1.5, max_itl_p99_regression=0.2) == 0  # bounds inclusive
    assert "FAIL" in capsys.readouterr().out


def test_a_lossless_failure_in_fp32_fails_but_bf16_numerics_do_not(tmp_path):
    assert run_gate(write_report(tmp_path, crafted_report(lossless=False))) == 1
    assert run_gate(write_report(tmp_path, crafted_report(lossless=False, lossless_exact_expected=False))) == 0


def test_missing_figure_fails_rather_than_passes(tmp_path):
    assert run_gate(write_report(tmp_path, crafted_report(alpha=None))) == 1


def test_blended_weights_use_token_shares_of_time_for_speedup():
    report = crafted_report()
    got = blend(report, {"chat": 0.7, "code": 0.3})
    assert got["alpha"] == pytest.approx(0.7 * 0.7 + 0.3 * 0.4)
    assert got["itl_p99_regression"] == pytest.approx(0.7 * 0.1 + 0.3 * 0.5)
    base_time = 0.7 / 100 + 0.3 / 50
    spec_time = 0.7 / 200 + 0.3 / 55
    assert got["speedup"] == pytest.approx(base_time / spec_time)
    # Unnormalised weights mean the same mix.
    assert blend(report, {"chat": 7, "code": 3}) == pytest.approx(got)


def test_blended_gate_differs_from_pooled_and_flags_string_weights(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report())
    # Pooled alpha 0.6 passes 0.58; a code-heavy mix blends to 0.7*0.3 + 0.4*0.7 = 0.49 and fails.
    assert run_gate(path, min_alpha=0.58) == 0
    assert run_gate(path, min_alpha=0.58, weights="chat=0.3,code=0.7") == 1
    assert run_gate(path, min_alpha=0.58, weights={"chat": 0.9, "code": 0.1}) == 0
    out = capsys.readouterr().out
    assert "blended" in out


def test_a_weighted_category_missing_from_the_report_fails(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path, weights="chat=0.7,math=0.3") == 1
    verdict = json.loads((path.parent / "gate.json").read_text())
    missing = [c for c in verdict["checks"] if c["name"] == "category" and c["scope"] == "math"]
    assert missing and missing[0]["passed"] is False and missing[0]["value"] == "missing"
    assert "math" in capsys.readouterr().out


def test_per_category_mode_requires_every_category_to_pass(tmp_path):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path, recipe=GateConfig(min_alpha=0.55)) == 0
    assert run_gate(path, recipe=GateConfig(min_alpha=0.55, per_category=True)) == 1  # code has 0.4


def test_recipe_thresholds_apply_and_flags_win(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("gate:\n  min_alpha: 0.65\n  weights: {chat: 1.0}\n")
    path = write_report(tmp_path, crafted_report())
    gate = resolve_thresholds(str(recipe))
    assert gate.min_alpha == 0.65 and gate.weights == {"chat": 1.0}
    assert run_gate(path, recipe=str(recipe)) == 0  # chat alone: alpha 0.7
    assert run_gate(path, recipe=str(recipe), min_alpha=0.75) == 1  # the flag wins
    assert run_gate(path, recipe=str(recipe), weights="code=1") == 1  # flag weights replace the recipe's


def test_a_loaded_recipe_is_accepted_as_eyas_run_passes_it(tmp_path):
    from eyas.recipe import Recipe

    path = write_report(tmp_path, crafted_report())
    recipe = Recipe(gate=GateConfig(min_alpha=0.9))
    assert run_gate(path, recipe=recipe) == 1
    assert run_gate(path, recipe=recipe) == 1
    assert run_gate(path, recipe=recipe, min_alpha=0.5) == 0


def test_weights_strings_are_parsed_and_bad_ones_named():
    assert parse_weights("chat=0.7, code=0.3") == {"chat": 0.7, "code": 0.3}
    assert parse_weights(None) == {}
    with pytest.raises(GateError, match="'chat' is not category=weight"):
        parse_weights("chat")
    with pytest.raises(GateError, match="'lots' for category 'code'"):
        parse_weights("code=lots")
    with pytest.raises(GateError, match="weight -1"):
        parse_weights({"chat": -1})


def test_not_a_bench_report_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="eyas bench"):
        run_gate(tmp_path / "nope.json")
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"alpha": 0.9}))
    with pytest.raises(GateError, match="'speedup'"):
        run_gate(bad)


def test_push_check_is_tied_to_the_head_hash_and_the_report_content(tmp_path):
    path = write_report(tmp_path, crafted_report())
    assert gate_passed_for(HEAD, path) is False  # no gate run yet
    assert run_gate(path) == 0
    assert gate_passed_for(HEAD, path) is True
    assert gate_passed_for("cd" * 32, path) is False  # another head
    # Editing the report after the gate voids the verdict.
    path.write_text(json.dumps(crafted_report(alpha=0.99)))
    assert gate_passed_for(HEAD, path) is False
    # A failed gate is not a pass, even for the right head.
    assert run_gate(path, min_alpha=1.0) == 1
    assert gate_passed_for(HEAD, path) is False


def test_a_gate_with_nothing_to_check_does_not_pass(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report(lossless_exact_expected=False))
    assert run_gate(path, recipe=GateConfig(min_alpha=None)) == 1
    assert "nothing was verified" in capsys.readouterr().out
    assert not gate_passed_for(HEAD, path)
