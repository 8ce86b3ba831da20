"""Two CPU processes (DDP and DeepSpeed ZeRO-2 over gloo): the data is really split, and the result matches
one process with the same global batch (grad_accum=2)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.configbase import from_dict
from eyas.heads.checkpoint import load_head
from eyas.recipe import Recipe
from eyas.stages import run_one
from test_train_fixtures import fresh_run, read_metrics, reset_accelerate, shared_pipeline, write_recipe

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "accelerate"
# 24 training samples, global batch 2 x 2 = 4: 6 steps are exactly one epoch.
SETTINGS = dict(max_steps=6, batch_size=2, eval_every=6, save_every=6, log_every=1, mixed_precision="fp32",
                log_sample_ids=True, lr=3e-3)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, grad_accum=2: the same global batch as two processes with grad_accum=1."""
    pipeline = shared_pipeline(tmp_path_factory)
    recipe = fresh_run(pipeline, tmp_path_factory.mktemp("single"), grad_accum=2, **SETTINGS)
    reset_accelerate()
    run_one("train", from_dict(Recipe, recipe))
    return pipeline, Path(recipe["output_dir"]) / "head"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(pipeline, tmp_path, launcher_args: list[str], env_extra: dict) -> Path:
    recipe = fresh_run(pipeline, tmp_path, grad_accum=1, **SETTINGS)
    recipe_file = write_recipe(tmp_path / "recipe.yaml", recipe)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, "--main_process_port", str(free_port()),
           "-m", "eyas", "train", str(recipe_file)]
    env = dict(os.environ, **env_extra)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=400)
    assert out.returncode == 0, out.stdout[-4000:]
    return Path(recipe["output_dir"]) / "head", out.stdout


def rows_by_step(head_dir: Path, rank: int) -> dict[int, list[int]]:
    lines = (head_dir / f"sample_ids.rank{rank}.jsonl").read_text().splitlines()
    return {r["step"]: r["rows"] for r in map(json.loads, lines)}


def check_split_and_match(head_dir: Path, single_dir: Path) -> None:
    rank0, rank1 = rows_by_step(head_dir, 0), rows_by_step(head_dir, 1)
    one = rows_by_step(single_dir, 0)
    assert sorted(rank0) == sorted(rank1) == list(range(1, 7))
    for step in rank0:
        assert not set(rank0[step]) & set(rank1[step]), f"step {step}: both ranks trained on the same samples"
        assert sorted(rank0[step] + rank1[step]) == sorted(one[step])  # the same global batch
    seen = [i for step in rank0 for i in rank0[step] + rank1[step]]
    assert sorted(seen) == list(range(24))  # disjoint and covering the epoch

    got, want = read_metrics(head_dir), read_metrics(single_dir)
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, 7))
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4), a["step"]
    two_head, _ = load_head(head_dir / "last")
    one_head, _ = load_head(single_dir / "last")
    for (name, p), q in zip(two_head.named_parameters(), one_head.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)
    moved = max((p - q).abs().max().item() for p, q in zip(two_head.parameters(), initial_head(head_dir).parameters()))
    assert moved > 1e-3  # training changed the weights, so the match above means something


def initial_head(head_dir: Path):
    from eyas.data.targets import Target
    from eyas.data.vocab import load_vocab
    from eyas.train.head_init import build_training_head

    recipe = from_dict(Recipe, json.loads(json.dumps(_recipe_of(head_dir))))
    return build_training_head(recipe.head, Target.resolve(recipe.target), load_vocab(recipe.stage_dir("vocab")),
                               recipe.train.seed)


def _recipe_of(head_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((head_dir.parents[1] / "recipe.yaml").read_text())


def test_ddp_two_cpu_processes_split_the_data_and_match_one_process(single, tmp_path):
    pipeline, single_dir = single
    head_dir, log = launch_two(pipeline, tmp_path, ["--multi_gpu", "--num_processes", "2"], {"ACCELERATE_USE_CPU": "1"})
    assert "2 process(es), DistributedType.MULTI_CPU" in log
    check_split_and_match(head_dir, single_dir)


def test_deepspeed_zero2_two_cpu_processes_split_the_data_and_match_one_process(single, tmp_path):
    pipeline, single_dir = single
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    head_dir, log = launch_two(pipeline, tmp_path, ["--config_file", str(ACCELERATE_CONFIGS / "cpu-zero2-2proc.yaml")],
                               {**env, "ACCELERATE_USE_CPU": "0"})
    assert "2 process(es), DistributedType.DEEPSPEED" in log
    check_split_and_match(head_dir, single_dir)
