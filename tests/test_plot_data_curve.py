"""The data curve (benchmarks/plot_data_curve.py) and the data figures bench_methods records for it: passes
counted over the stored samples, points grouped by passes, the log-linear fit and its extrapolation, a PNG, and
one clear line for a result that cannot give a point."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_methods  # noqa: E402
import plot_data_curve  # noqa: E402


def write_result(path: Path, variant: str, tokens: int, passes: float, alpha: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"variant": variant, "data": {"answer_tokens": tokens, "passes": passes},
                                "acceptance": {"alpha": alpha}}))
    return path


def test_data_figures_count_passes_over_the_stored_samples(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "features").mkdir()
    (tmp_path / "data" / "stats.json").write_text(json.dumps(
        {"splits": {"train": {"samples": 250, "tokens": 40000, "masked_tokens": 26000}}}))
    # collect.max_records stored fewer than prepare wrote: the passes are over the 200 stored samples.
    (tmp_path / "features" / "index.json").write_text(json.dumps({"splits": {"train": {"num_samples": 200}}}))
    figures = bench_methods.data_figures("smollm2-135m-cpu", [f"output_dir={tmp_path}", "train.batch_size=4",
                                                              "train.grad_accum=2"], steps=100, num_processes=2)
    assert figures == {"train_samples": 250, "answer_tokens": 26000, "collected_samples": 200, "passes": 8.0}


def test_fit_groups_by_passes_and_extrapolates(tmp_path, capsys):
    # Exactly alpha = 0.03 ln(tokens) - 0.2 at 5 passes; one point at 20 passes that must not join the line.
    results = [write_result(tmp_path / f"r{i}" / "method.json", f"size{i}", t, 4.98 + 0.01 * i,
                            0.03 * math.log(t) - 0.2) for i, t in enumerate((20_000, 80_000, 160_000))]
    results.append(write_result(tmp_path / "e20" / "method.json", "epochs-20", 20_000, 19.9, 0.15))
    out = tmp_path / "curve.png"
    assert plot_data_curve.main([*map(str, results), "--out", str(out), "--targets", "0.25"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    groups = plot_data_curve.curves([plot_data_curve.load_point(p) for p in results])
    assert sorted(groups) == [5, 20] and "fit" not in groups[20]
    slope, intercept = groups[5]["fit"]
    assert slope == pytest.approx(0.03) and intercept == pytest.approx(-0.2)
    reach = plot_data_curve.tokens_at(0.25, slope, intercept)
    assert reach == pytest.approx(math.exp(0.45 / 0.03), rel=1e-6)
    printed = capsys.readouterr().out
    assert "5 passes: +0.0300 acceptance per e-fold" in printed
    assert f"0.25 at ~{reach / 160_000:,.0f}x the largest" in printed
    assert plot_data_curve.tokens_at(0.25, -0.01, 0.3) == math.inf  # a falling line never reaches a bar


def test_result_without_data_is_named(tmp_path):
    old = tmp_path / "old" / "method.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"variant": "baseline", "acceptance": {"alpha": 0.12}}))
    with pytest.raises(SystemExit, match=rf"{old}: no data.answer_tokens"):
        plot_data_curve.load_point(old)
    unfinished = write_result(tmp_path / "unfinished" / "method.json", "baseline", 26000, 5.0, 0.1)
    unfinished.write_text(json.dumps({"data": {"answer_tokens": 26000, "passes": 5.0}}))
    with pytest.raises(SystemExit, match=rf"{unfinished}: no acceptance.alpha \(not a finished"):
        plot_data_curve.load_point(unfinished)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(SystemExit, match=rf"{broken}: not a readable method.json"):
        plot_data_curve.load_point(broken)


def test_bad_targets_value_is_one_line(tmp_path, capsys):
    result = write_result(tmp_path / "r" / "method.json", "baseline", 26000, 5.0, 0.12)
    with pytest.raises(SystemExit):
        plot_data_curve.main([str(result), "--out", str(tmp_path / "c.png"), "--targets", "0.25,high"])
    assert "--targets '0.25,high': acceptance bars are numbers" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()
