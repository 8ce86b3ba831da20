"""The training loop on a tiny real pipeline (random-weight Llama, real tokenizer and text, real collect)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.configbase import from_dict
from eyas.data.stage import read_done
from eyas.data.targets import Target, target_hash
from eyas.data.vocab import load_vocab
from eyas.heads.checkpoint import load_head
from eyas.recipe import Recipe
from eyas.stages import run_one
from eyas.train.data import Features, TrainingError, TrainPaths
from eyas.train.head_init import build_training_head
from eyas.train.loop import lr_factor
from eyas.train.loss import ttt_loss
from test_train_fixtures import fresh_run, read_metrics, reset_accelerate, shared_pipeline, write_recipe


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return shared_pipeline(tmp_path_factory)


def train_in_process(recipe: dict) -> Path:
    """`eyas train` in this process (skipped when head/DONE.json matches); returns head/best."""
    reset_accelerate()
    return run_one("train", from_dict(Recipe, recipe)) / "best"


def test_offline_training_writes_heads_metrics_plot_and_done(pipeline, tmp_path):
    recipe = fresh_run(pipeline, tmp_path, trackers=["tensorboard"])
    best = train_in_process(recipe)
    head_dir = best.parent
    r = from_dict(Recipe, recipe)
    tokenizer = Target.resolve(r.target).tokenizer
    head, meta = load_head(best, tokenizer=tokenizer, target_vocab_size=len(tokenizer))
    assert meta["target_hash"] == target_hash(recipe["target"]["name_or_path"])
    assert head.config.aux_layer_ids == [0, 1, 2]
    d2t, t2d = load_vocab(Path(recipe["output_dir"]) / "vocab")
    assert torch.equal(head.d2t, d2t) and torch.equal(head.t2d, t2d)
    load_head(head_dir / "last")

    train = read_metrics(head_dir)
    val = read_metrics(head_dir, "val")
    assert [m["step"] for m in train] == list(range(1, 7)) and [m["step"] for m in val] == [3, 6]
    assert train[-1]["loss"] < train[0]["loss"]  # it learns
    assert meta["training"]["val"]["tau_sim"] == max(v["tau_sim"] for v in val)
    assert len(val[0]["step_acc"]) == 3 and val[0]["tau_positions"] > 0
    assert (head_dir / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert list(head_dir.rglob("events.out.tfevents*"))  # the tensorboard tracker logged
    done = read_done(head_dir)
    assert done["stage"] == "train" and done["steps"] == 6 and done["best_tau_sim"] == max(v["tau_sim"] for v in val)
    assert json.loads((head_dir / "state" / "progress.json").read_text())["step"] == 6
    # Up to date: a second `eyas train` skips, leaving DONE (and its time stamp) as it was.
    train_in_process(recipe)
    assert read_done(head_dir) == done


def test_online_and_offline_give_the_same_loss_on_the_same_batch(pipeline, tmp_path):
    offline = from_dict(Recipe, pipeline)
    online = from_dict(Recipe, dict(pipeline, collect=dict(pipeline["collect"], mode="online")))
    target = Target.resolve(offline.target)
    vocab = load_vocab(offline.stage_dir("vocab"))
    head = build_training_head(offline.head, target, vocab, offline.train.seed)
    weight = target.input_embedding()
    paths = TrainPaths(data=offline.stage_dir("data"), vocab=offline.stage_dir("vocab"),
                       features=offline.stage_dir("features"), head=tmp_path / "head")
    losses = []
    for recipe in (offline, online):
        batch, teacher = Features(recipe.collect, target, paths, vocab, torch.device("cpu")).batch("train", [3, 11, 17])
        out = ttt_loss(head, weight, dict(batch, aux=batch["aux"].float()), teacher, ttt_steps=3)
        losses.append(out)
    assert losses[0].step_count.tolist() == losses[1].step_count.tolist() and losses[0].step_count[0] > 20
    torch.testing.assert_close(losses[0].step_losses, losses[1].step_losses, atol=1e-5, rtol=1e-5)


def test_non_finite_loss_stops_with_a_clear_message(pipeline, tmp_path):
    recipe = fresh_run(pipeline, tmp_path, lr=1e8, eval_every=1, max_steps=3, mixed_precision="fp32")
    with pytest.raises(TrainingError, match="non-finite .* at step 2.*last good head"):
        train_in_process(recipe)
    head_dir = Path(recipe["output_dir"]) / "head"
    last, _ = load_head(head_dir / "last")  # from step 1, finite
    assert all(torch.isfinite(p).all() for p in last.parameters())
    assert not (head_dir / "DONE.json").exists()


def test_lr_schedule_warms_up_then_decays_to_min_ratio():
    f = [lr_factor(s, warmup=4, total=20, min_ratio=0.1) for s in range(21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:], f[5:])) and f[20] == pytest.approx(0.1)


def test_lr_schedules_differ_after_warmup_only():
    cos, lin, const = ([lr_factor(s, warmup=4, total=20, min_ratio=0.1, schedule=k) for s in range(21)]
                       for k in ("cosine", "linear", "constant"))
    assert cos[:5] == lin[:5] == const[:5]
    assert lin[12] == pytest.approx(0.1 + 0.9 * 0.5) and lin[20] == pytest.approx(0.1)
    assert cos[8] > lin[8] and cos[16] < lin[16]  # the cosine stays high longer, then falls faster
    assert const[4:] == [1.0] * 17


class Crash(Exception):
    pass


def test_crash_then_resume_in_process_gives_the_same_loss_curve(pipeline, tmp_path, monkeypatch):
    """In-process variant of the SIGKILL test below: a crash injected at step 5, after the state of step 4."""
    from eyas.train import loop

    steps = dict(max_steps=7, save_every=2, eval_every=7, log_every=1, mixed_precision="fp32")
    reference = fresh_run(pipeline, tmp_path / "ref", **steps)
    crashed = fresh_run(pipeline, tmp_path / "crashed", **steps)
    train_in_process(reference)

    real = loop.Plan.micro_batches

    def crash_at_step_4(self, step):
        if step == 4:  # 0-based: the fifth optimizer step
            raise Crash()
        return real(self, step)

    monkeypatch.setattr(loop.Plan, "micro_batches", crash_at_step_4)
    with pytest.raises(Crash):
        train_in_process(crashed)
    head_dir = Path(crashed["output_dir"]) / "head"
    assert json.loads((head_dir / "state" / "progress.json").read_text())["step"] == 4
    monkeypatch.setattr(loop.Plan, "micro_batches", real)
    train_in_process(crashed)
    want, got = read_metrics(Path(reference["output_dir"]) / "head"), read_metrics(head_dir)
    assert [m["step"] for m in got] == list(range(1, 8))
    for a, b in zip(want, got):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), a["step"]


def test_kill_9_then_resume_gives_the_same_loss_curve(pipeline, tmp_path):
    steps = dict(max_steps=14, save_every=3, eval_every=14, log_every=1, mixed_precision="fp32")
    reference = fresh_run(pipeline, tmp_path / "ref", **steps)
    killed = fresh_run(pipeline, tmp_path / "killed", **steps)
    recipe_file = write_recipe(tmp_path / "killed.yaml", killed)
    head_dir = Path(killed["output_dir"]) / "head"
    cmd = [sys.executable, "-m", "eyas", "train", str(recipe_file)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    progress = head_dir / "state" / "progress.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if progress.exists() and json.loads(progress.read_text())["step"] >= 6:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (head_dir / "DONE.json").exists(), "the run finished before the kill; nothing was tested"
    saved_step = json.loads(progress.read_text())["step"]
    assert 6 <= saved_step < 14

    resumed = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming from {head_dir / 'state'} at step {saved_step}" in resumed.stdout

    train_in_process(reference)
    want = read_metrics(Path(reference["output_dir"]) / "head")
    got = read_metrics(head_dir)
    assert [m["step"] for m in got] == list(range(1, 15))
    for a, b in zip(want, got):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), a["step"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)


def test_features_of_other_aux_layers_are_refused_naming_the_file_and_field(pipeline, tmp_path):
    recipe = fresh_run(pipeline, tmp_path)
    recipe["target"] = dict(recipe["target"], aux_layer_ids=[1, 2, 3])
    with pytest.raises(TrainingError, match=r"index\.json: field 'aux_layer_ids' is \[0, 1, 2\]"):
        train_in_process(recipe)


def test_features_of_another_draft_vocabulary_of_the_same_size_are_refused(pipeline, tmp_path):
    """The vocab stage was redone (same size, other tokens) but the store was not: its teacher is indexed
    by the old draft ids, so training on it would learn the wrong tokens."""
    from eyas.data.vocab import build_mapping, save_vocab

    recipe = fresh_run(pipeline, tmp_path)
    vocab_dir = Path(recipe["output_dir"]) / "vocab"
    d2t, t2d = load_vocab(vocab_dir)
    kept = (torch.arange(len(d2t)) + d2t).tolist()
    other = sorted(set(range(t2d.numel())) - set(kept))[:1] + kept[1:]  # one token swapped for an unseen one
    save_vocab(vocab_dir / "vocab.safetensors", *build_mapping(torch.tensor(other), t2d.numel()))
    with pytest.raises(TrainingError, match=r"teacher\.safetensors: field 'd2t' differs from the vocab stage's "
                                            r"\(\d+ of \d+ draft ids map elsewhere\)"):
        train_in_process(recipe)


def test_hidden_loss_with_a_topk_store_is_refused_in_one_line(pipeline, tmp_path):
    recipe = fresh_run(pipeline, tmp_path)
    recipe["collect"] = dict(recipe.get("collect", {}), teacher="topk")
    recipe["train"] = dict(recipe["train"], hidden_loss_weight=1.0)
    with pytest.raises(TrainingError, match=r"train\.hidden_loss_weight=1\.0 needs the target's final hidden states, "
                                            r"and collect\.teacher=topk stores none"):
        train_in_process(recipe)
