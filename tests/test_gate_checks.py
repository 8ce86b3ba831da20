"""The release gate on crafted reports: thresholds, blended traffic weights, exit code and gate.json; and the
report schema every reader goes through."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eyas.eval.config import GateConfig
from eyas.eval.gate import GateError, blend, gate_passed_for, parse_weights, run_gate
from eyas.eval.report import REPORT_SCHEMA_VERSION, ReportError, load_report, make_report

HEAD = "ab" * 32


def category(alpha, speedup, base_tps, itl_reg):
    return {"prompts": 4, "tau": 1 + 2 * alpha, "alpha": alpha, "speedup": speedup, "baseline_tokens_per_s": base_tps,
            "spec_tokens_per_s": base_tps * speedup, "itl_p99_regression": itl_reg, "lossless": True}


def crafted_report(head: str = HEAD, head_path: str = "/heads/best", **overrides) -> dict:
    """A report with every field of the schema, as `eyas bench` writes it, and two categories."""
    return make_report({
        "prompts": 8, "tau": 2.2, "alpha": 0.6, "speedup": 1.5, "spec_tokens_per_s": 90.0,
        "baseline_tokens_per_s": 60.0, "itl_p99_regression": 0.2, "lossless": True,
        "lossless_exact_expected": True, "alpha_per_position": [0.8, 0.6, 0.4], "alpha_chain_length": 3,
        "by_category": {"chat": category(0.7, 2.0, 100.0, 0.1), "code": category(0.4, 1.1, 50.0, 0.5)},
        "decoder": {"mode": "chain", "num_speculative_tokens": 3, "depth": 3, "topk": 1, "budget": 3},
        "head": {"path": head_path, "sha256": head},
        "target": {"name": "tiny-target", "sha256": "cd" * 32, "matches_head": True},
        "environment": {"device": "cpu", "dtype": "float32", "cuda_device": None},
        "noise": {"trustworthy": True, "warnings": []},
        **overrides,
    })


def write_report(tmp_path: Path, report: dict) -> Path:
    path = tmp_path / "bench" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return path


def test_default_min_alpha_passes_and_writes_a_verdict_for_this_head(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path, GateConfig()) == 0
    verdict = json.loads((path.parent / "gate.json").read_text())
    assert verdict["passed"] is True and verdict["head_sha256"] == HEAD
    assert [c["name"] for c in verdict["checks"]] == ["alpha", "lossless"]
    assert verdict["thresholds"]["min_alpha"] == 0.55
    out = capsys.readouterr().out
    assert "alpha" in out and ">= 0.55" in out and "verdict: PASS" in out


def test_each_threshold_can_fail_and_the_exit_code_is_1(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path, GateConfig(min_alpha=0.61)) == 1
    assert run_gate(path, GateConfig(min_speedup=1.6)) == 1
    assert run_gate(path, GateConfig(max_itl_p99_regression=0.19)) == 1
    assert run_gate(path, GateConfig(min_alpha=0.6, min_speedup=1.5, max_itl_p99_regression=0.2)) == 0  # inclusive
    assert "FAIL" in capsys.readouterr().out


def test_a_lossless_failure_in_fp32_fails_but_bf16_numerics_do_not(tmp_path):
    assert run_gate(write_report(tmp_path, crafted_report(lossless=False)), GateConfig()) == 1
    assert run_gate(write_report(tmp_path, crafted_report(lossless=False, lossless_exact_expected=False)),
                    GateConfig()) == 0


def test_missing_figure_fails_rather_than_passes(tmp_path):
    assert run_gate(write_report(tmp_path, crafted_report(alpha=None)), GateConfig()) == 1


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
    assert run_gate(path, GateConfig(min_alpha=0.58)) == 0
    assert run_gate(path, GateConfig(min_alpha=0.58, weights=parse_weights("chat=0.3,code=0.7"))) == 1
    assert run_gate(path, GateConfig(min_alpha=0.58, weights={"chat": 0.9, "code": 0.1})) == 0
    with pytest.raises(GateError, match="weight -1"):  # a recipe's weights are checked too
        run_gate(path, GateConfig(weights={"chat": -1}))
    out = capsys.readouterr().out
    assert "blended" in out


def test_a_weighted_category_missing_from_the_report_fails(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path, GateConfig(weights={"chat": 0.7, "math": 0.3})) == 1
    verdict = json.loads((path.parent / "gate.json").read_text())
    missing = [c for c in verdict["checks"] if c["name"] == "category" and c["scope"] == "math"]
    assert missing and missing[0]["passed"] is False and missing[0]["value"] == "missing"
    assert "math" in capsys.readouterr().out


def test_per_category_mode_requires_every_category_to_pass(tmp_path):
    path = write_report(tmp_path, crafted_report())
    assert run_gate(path, GateConfig(min_alpha=0.55)) == 0
    assert run_gate(path, GateConfig(min_alpha=0.55, per_category=True)) == 1  # code has 0.4


def test_recipe_thresholds_apply_and_flags_win_on_the_command_line(tmp_path):
    from eyas.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("gate:\n  min_alpha: 0.65\n  weights: {chat: 1.0}\n")
    path = write_report(tmp_path, crafted_report())
    assert main(["gate", str(path), "--recipe", str(recipe)]) == 0  # chat alone: alpha 0.7
    assert json.loads((path.parent / "gate.json").read_text())["thresholds"]["weights"] == {"chat": 1.0}
    assert main(["gate", str(path), "--recipe", str(recipe), "--min-alpha", "0.75"]) == 1  # the flag wins
    assert main(["gate", str(path), "--recipe", str(recipe), "--weights", "code=1"]) == 1  # flag weights replace


def test_eyas_run_gates_with_the_recipe_gate_section(tmp_path):
    from eyas.recipe import Recipe
    from eyas.stages import run_one

    recipe = Recipe(output_dir=str(tmp_path), gate=GateConfig(min_alpha=0.9))
    write_report(tmp_path, crafted_report())  # where the bench stage writes it: <output_dir>/bench/report.json
    assert run_one("gate", recipe) == 1
    assert run_one("gate", Recipe(output_dir=str(tmp_path), gate=GateConfig(min_alpha=0.5))) == 0


def test_weights_strings_are_parsed_and_bad_ones_named():
    assert parse_weights("chat=0.7, code=0.3") == {"chat": 0.7, "code": 0.3}
    assert parse_weights(None) == {}
    with pytest.raises(GateError, match="'chat' is not category=weight"):
        parse_weights("chat")
    with pytest.raises(GateError, match="'lots' for category 'code'"):
        parse_weights("code=lots")
    with pytest.raises(GateError, match="weight -1"):
        parse_weights({"chat": -1})


def test_not_a_bench_report_is_refused_naming_the_field(tmp_path):
    from eyas.cli import main

    with pytest.raises(FileNotFoundError, match="eyas bench"):
        run_gate(tmp_path / "nope.json", GateConfig())
    report = crafted_report()
    del report["speedup"]
    bad = write_report(tmp_path, report)
    with pytest.raises(ReportError, match="field 'speedup' is missing"):
        run_gate(bad, GateConfig())
    assert not (bad.parent / "gate.json").exists()
    assert main(["gate", str(bad)]) == 2  # one line, no traceback


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.pop("schema_version"), "field 'schema_version' is missing"),
    (lambda r: r.update(schema_version=REPORT_SCHEMA_VERSION + 1), f"this eyas reads version {REPORT_SCHEMA_VERSION}"),
    (lambda r: r.update(alpha="high"), "field 'alpha' is 'high', expected a number or null"),
    (lambda r: r.update(lossless=1), "field 'lossless' is 1, expected true, false or null"),
    (lambda r: r["head"].pop("sha256"), "field 'head.sha256' is missing"),
    (lambda r: r["decoder"].update(topk=None), "field 'decoder.topk' is None, expected an integer"),
    (lambda r: r["by_category"]["code"].pop("alpha"), "field 'by_category.code.alpha' is missing"),
    (lambda r: r.update(by_category={"chat": 3}), "field 'by_category.chat' is 3, expected an object"),
    (lambda r: r.pop("noise"), "field 'noise' is missing"),
    (lambda r: r["noise"].update(trustworthy="maybe"), "field 'noise.trustworthy' is 'maybe', expected true, false"),
    (lambda r: r["target"].pop("matches_head"), "field 'target.matches_head' is missing"),
])
def test_the_schema_names_a_missing_or_wrong_field_in_one_line(tmp_path, edit, message):
    report = crafted_report()
    edit(report)
    path = write_report(tmp_path, report)
    with pytest.raises(ReportError) as err:
        load_report(path)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)
    if "'schema_version' is missing" not in message:  # make_report stamps the version itself
        with pytest.raises(ReportError, match=re.escape(message)):
            make_report(report)  # bench cannot write such a report either


def test_a_report_round_trips_through_the_schema(tmp_path):
    report = crafted_report(alpha=float("nan"))  # NaN is not JSON: stored as null
    assert report["schema_version"] == REPORT_SCHEMA_VERSION and report["alpha"] is None
    assert load_report(write_report(tmp_path, report)) == report
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ReportError, match="not valid JSON"):
        load_report(bad)


def test_push_check_is_tied_to_the_head_hash_and_the_report_content(tmp_path):
    path = write_report(tmp_path, crafted_report())
    assert gate_passed_for(HEAD, path) is False  # no gate run yet
    assert run_gate(path, GateConfig()) == 0
    assert gate_passed_for(HEAD, path) is True
    assert gate_passed_for("cd" * 32, path) is False  # another head
    # Editing the report after the gate voids the verdict.
    path.write_text(json.dumps(crafted_report(alpha=0.99)))
    assert gate_passed_for(HEAD, path) is False
    # A failed gate is not a pass, even for the right head.
    assert run_gate(path, GateConfig(min_alpha=1.0)) == 1
    assert gate_passed_for(HEAD, path) is False


def test_a_gate_with_nothing_to_check_does_not_pass(tmp_path, capsys):
    path = write_report(tmp_path, crafted_report(lossless_exact_expected=False))
    assert run_gate(path, GateConfig(min_alpha=None)) == 1
    assert "nothing was verified" in capsys.readouterr().out
    assert not gate_passed_for(HEAD, path)


def test_a_report_of_the_previous_schema_still_loads_with_noise_and_target_match_unknown(tmp_path):
    report = crafted_report()
    del report["noise"], report["target"]["matches_head"]
    report["schema_version"] = 1
    loaded = load_report(write_report(tmp_path, report))
    assert loaded["schema_version"] == REPORT_SCHEMA_VERSION == 2
    assert loaded["target"]["matches_head"] is None
    assert loaded["noise"]["trustworthy"] is None and "schema 1" in loaded["noise"]["warnings"][0]
    assert run_gate(write_report(tmp_path, report), GateConfig()) == 0
    report["schema_version"] = 0
    with pytest.raises(ReportError, match="'schema_version' is 0, this eyas reads version 2 \\(and version 1"):
        load_report(write_report(tmp_path, report))


def test_a_report_measured_on_other_target_weights_fails_the_gate(tmp_path, capsys):
    report = crafted_report()
    report["target"]["matches_head"] = False
    assert run_gate(write_report(tmp_path, report), GateConfig()) == 1
    verdict = json.loads((tmp_path / "bench" / "gate.json").read_text())
    failed = [c for c in verdict["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["target"]
    assert "target" in capsys.readouterr().out


def test_the_speedup_bar_is_checked_against_the_fastest_plain_decoding():
    """A head that beats eyas' plain decoder but not transformers' generate() does not pass a speedup bar."""
    from eyas.eval.aggregate import fastest_plain
    from eyas.eval.config import GateConfig
    from eyas.eval.gate import threshold_checks

    figures = {"speedup": 1.2, "spec_tokens_per_s": 24.0, "baseline_tokens_per_s": 20.0,
               "hf_generate_tokens_per_s": 30.0}
    figures.update(fastest_plain(figures))
    assert figures["fastest_plain"] == {"decoder": "transformers generate()", "tokens_per_s": 30.0}
    assert figures["speedup_vs_fastest_plain"] == pytest.approx(0.8)
    [check] = threshold_checks(figures, "all", GateConfig(min_alpha=None, min_speedup=1.0))
    assert check.value == pytest.approx(0.8) and not check.passed
