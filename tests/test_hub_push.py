"""`eyas push`: the gate check per head hash, the staged upload and card, and clean failures without a token/network."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest

from eyas.eval.config import GateConfig
from eyas.eval.gate import run_gate
from eyas.eval.hub import PushError, push
from eyas.eval.report import serving_settings
from eyas.heads.checkpoint import head_content_hash
from eyas.heads.export import export_head
from test_export_formats import tiny_head_dir, tiny_target
from test_gate_checks import crafted_report

matplotlib.use("Agg")


def bench_report(folder: Path, head_dir: Path, alpha: float = 0.7) -> Path:
    """A report.json shaped like `eyas bench` writes it, with two categories and a real PNG plot."""
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    figures = {"prompts": 4, "alpha": alpha, "tau": 2.9, "speedup": 1.8, "spec_tokens_per_s": 90.0,
               "baseline_tokens_per_s": 50.0, "itl_p99_regression": 0.1, "lossless": True}
    report = crafted_report(head=head_content_hash(head_dir), head_path=str(head_dir), **dict(figures, prompts=8),
                            alpha_per_position=[0.8, 0.7, 0.6], alpha_chain_length=3,
                            by_category={"chat": dict(figures, alpha=0.62, tau=2.4, speedup=1.5),
                                         "code": dict(figures, alpha=0.81, tau=3.3, speedup=2.2)},
                            decoder={"mode": "tree", "num_speculative_tokens": 3, "depth": 4, "topk": 2, "budget": 6})
    path = folder / "report.json"
    path.write_text(json.dumps(report))
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2, 3], [0.8, 0.7, 0.6])
    fig.savefig(folder / "acceptance_per_position.png")
    plt.close(fig)
    return path


@pytest.fixture()
def gated_export(tmp_path, monkeypatch):
    """A speculators export of a tiny head whose bench report passed the real gate; network made unreachable."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login either
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    target, target_dir = tiny_target(tmp_path / "target")
    (target_dir / "README.md").write_text("---\nlicense: mit\n---\n# tiny target\n")
    head_dir = tiny_head_dir(tmp_path / "head", target, target_dir)
    report = bench_report(tmp_path / "bench", head_dir)
    assert run_gate(report, GateConfig(min_alpha=0.55)) == 0
    out = export_head(head_dir, "speculators", tmp_path / "export", settings=serving_settings(report),
                      verifier=str(target_dir))
    return tmp_path, out, head_dir, report


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_dry_run_prints_file_list_and_complete_card(gated_export, capsys):
    tmp_path, out, head_dir, _ = gated_export
    before = snapshot(out)
    assert push(out, "someone/tiny-eagle3", dry_run=True) == 0
    printed = capsys.readouterr().out
    for name in ("README.md", "config.json", "model.safetensors", "eyas_export.json", "SERVING.md",
                 "plots/acceptance_per_position.png"):
        assert f"  {name}  (" in printed, name
    card = printed.split("----- README.md (model card) -----\n", 1)[1]
    meta = card.split("---\n")[1]
    assert "library_name: speculators" in meta and "license: mit" in meta and "eagle3" in meta
    assert "| all prompts | 0.700 | 2.900 | 1.800 |" in card
    assert "| chat | 0.620 | 2.400 | 1.500 |" in card and "| code | 0.810 | 3.300 | 2.200 |" in card
    assert "Verdict: **PASS**" in card and "min_alpha 0.55" in card
    assert "![acceptance_per_position](plots/acceptance_per_position.png)" in card
    assert "vllm serve someone/tiny-eagle3" in card
    spec = json.dumps({"method": "eagle3", "model": "someone/tiny-eagle3", "num_speculative_tokens": 3})
    assert f"--speculative-config '{spec}'" in card
    assert head_content_hash(head_dir) in card and "--force" not in card
    assert snapshot(out) == before
    assert not list(tmp_path.glob("eyas-push-*"))  # the staging folder is gone


def test_refuses_without_gate_and_force_is_recorded(gated_export, capsys):
    tmp_path, out, head_dir, report = gated_export
    report.with_name("gate.json").unlink()
    assert push(out, "someone/x", dry_run=True) == 1
    assert "refused: no gate.json" in capsys.readouterr().out
    assert push(out, "someone/x", dry_run=True, force=True) == 0
    card = capsys.readouterr().out
    assert "Verdict: **none**" in card and "Published with `--force`" in card


def test_refuses_gate_of_another_head_or_a_failed_gate(gated_export, capsys):
    tmp_path, out, head_dir, report = gated_export
    target, target_dir = tiny_target(tmp_path / "target2", seed=5)
    other_head = tiny_head_dir(tmp_path / "other-head", target, target_dir, seed=7)
    other = export_head(other_head, "sglang", tmp_path / "other-export", settings=serving_settings(report))
    assert push(other, "someone/x", dry_run=True) == 1
    assert "is for head" in capsys.readouterr().out
    failing = bench_report(tmp_path / "bench-fail", head_dir, alpha=0.3)
    assert run_gate(failing, GateConfig(min_alpha=0.55)) == 1
    capsys.readouterr()
    assert push(out, "someone/x", report=failing, dry_run=True) == 1
    assert "the gate failed" in capsys.readouterr().out


def test_refuses_weights_edited_after_export(gated_export):
    from safetensors.torch import load_file, save_file

    _, out, _, _ = gated_export
    tensors = load_file(str(out / "model.safetensors"))
    tensors["norm.weight"] = tensors["norm.weight"] * 2
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(PushError, match="changed after `eyas export`"):
        push(out, "someone/x", dry_run=True)


def test_no_token_is_a_clear_error_and_nothing_is_written(gated_export):
    tmp_path, out, _, _ = gated_export
    before = snapshot(out)
    with pytest.raises(PushError, match="no Hugging Face token"):
        push(out, "someone/x")
    assert snapshot(out) == before
    assert not list(tmp_path.glob("eyas-push-*"))


def test_no_network_is_a_clear_error_without_leaking_the_token(gated_export, monkeypatch, capsys):
    tmp_path, out, _, _ = gated_export
    secret = "hf_eyasTestTokenThatMustNeverBePrinted"
    monkeypatch.setenv("HF_TOKEN", secret)
    before = snapshot(out)
    with pytest.raises(PushError, match="could not push to someone/x") as err:
        push(out, "someone/x")
    printed = capsys.readouterr()
    assert secret not in str(err.value) and secret not in printed.out + printed.err
    assert snapshot(out) == before
    assert not list(tmp_path.glob("eyas-push-*"))


def test_cli_push_dry_run(gated_export, capsys):
    from eyas.cli import main

    _, out, _, _ = gated_export
    assert main(["push", str(out), "--repo-id", "someone/tiny", "--dry-run"]) == 0
    assert "would upload" in capsys.readouterr().out
    assert main(["push", str(out.parent / "nope"), "--repo-id", "someone/tiny", "--dry-run"]) == 2
