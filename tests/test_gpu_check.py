"""The GPU check (scripts/gpu_check.sh) in its reduced CPU mode: every section runs and passes, so the script
that waits for a GPU cannot rot; and its lossless check really compares outputs (a broken decoder fails it)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("lossless", "train_throughput", "cost_model", "accelerate_launch")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--cpu"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert (out / "gpu_check.json").exists(), proc.stdout[-4000:]
    data = json.loads((out / "gpu_check.json").read_text())
    return proc, data, (out / "gpu_check.md").read_text()


def test_every_section_runs_ok_in_cpu_mode(report):
    proc, data, md = report
    statuses = {name: data["sections"].get(name, {}).get("status") for name in SECTIONS}
    details = {n: data["sections"][n].get("error") or data["sections"][n].get("results", {}).get("failures")
               for n in SECTIONS if n in data["sections"]}
    assert statuses == dict.fromkeys(SECTIONS, "ok"), f"{statuses}\n{details}\n{proc.stdout[-3000:]}"
    assert proc.returncode == 0
    # eyas came from the script's folder of links (the checkout's layout, not an installed copy).
    assert data["environment"]["eyas_imported_from"].endswith(os.path.join("pkg", "eyas"))
    for name in SECTIONS:
        assert f"## {name}: ok" in md


def test_cpu_mode_results_are_complete(report):
    _, data, _ = report
    lossless = data["sections"]["lossless"]["results"]
    for arch in ("llama", "qwen3", "gemma3"):
        for mode in ("chain", "tree"):
            row = lossless["greedy"][arch][f"fp32_{mode}"]
            assert row["all_identical"] and row["accepted_beyond_depth_1"] > 0, (arch, mode, row)
        assert 0.0 <= lossless["greedy"][arch]["bf16_chain"]["token_agreement"] <= 1.0
    chain = lossless["sampling"]["chain"]
    assert chain["tv"] < chain["tv_threshold_p999"]

    train = data["sections"]["train_throughput"]["results"]
    for mode in ("offline", "online"):
        row = train[mode]
        assert row["tokens_per_s"] > 0 and row["loss_finite"] and math.isfinite(row["loss"])
        assert len(row["trained_positions_per_ttt_step"]) == 7
        assert 0 < row["model_tflop_per_step"] < row["counted_tflop_per_step"]
    # The analytic FLOP formula agrees with torch's counter on the executed matmuls (the model count leaves
    # out the masked half of attention, so it is smaller, above).
    assert train["offline"]["counted_over_analytic_executed"] == pytest.approx(1.0, abs=0.03)

    cost = data["sections"]["cost_model"]["results"]
    for times in cost["forward_ms"].values():
        assert sorted(int(q) for q in times) == [1, 2, 4, 8, 16, 32, 64]
    from eyas.eval.autotune import default_shapes

    assert [r["shape"] for r in cost["shapes"]] == [dict(s) for s in default_shapes(torch.device("cpu"))]
    for row in cost["shapes"]:
        m = row["measured"]
        assert m["steps"] >= 1 and m["target_ms"] > 0 and m["draft_ms"] > 0 and row["predicted_step_ms"] > 0

    launch = data["sections"]["accelerate_launch"]["results"]
    assert [s["rc"] for s in launch["stages"]] == [0, 0, 0]
    run = launch["launches"]["cpu"]
    assert run["ok"] and [step for step, _ in run["losses"]] == [1, 2]


def test_lossless_check_reports_a_broken_decoder(monkeypatch):
    """A decoder whose last token differs from plain decoding must be reported, not pass as identical."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check_lossless
    from gpu_check_common import TINY, Ctx

    from eyas.eval.decoder import SpeculativeDecoder

    generate = SpeculativeDecoder.generate

    def broken(self, input_ids):
        stats = generate(self, input_ids)
        stats.tokens[-1] = (stats.tokens[-1] + 1) % gpu_check_lossless.VOCAB
        return stats

    monkeypatch.setattr(SpeculativeDecoder, "generate", broken)
    ctx = Ctx(device=torch.device("cpu"), cpu=True, out=Path("."), deadline=math.inf, shape=TINY)
    out, failures = gpu_check_lossless.greedy_case(ctx, "llama")
    assert not out["fp32_chain"]["all_identical"] and not out["fp32_tree"]["all_identical"]
    assert out["fp32_chain"]["token_agreement"] < 1.0
    assert any("differs from plain greedy" in f for f in failures)
