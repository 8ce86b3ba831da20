"""`accelerate launch` with 2 CPU processes: each rank writes its own shards, together covering every sample once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eyas.data.collect import plan_shards
from eyas.data.features import FeatureDataset
from eyas.recipe import dump_recipe

from test_collect_store import build_tiny_target, make_recipe

SCRIPT = """
import sys, torch
from eyas.recipe import load_recipe
from eyas.stages import run_one
torch.set_num_threads(1)
run_one("collect", load_recipe(sys.argv[1]))
"""


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_plans_of_ranks_are_disjoint_and_cover_every_sample(world):
    lengths = [7, 3, 12, 5, 5, 9, 1, 30, 2, 8, 4]
    rows = [[r for shard in plan_shards(lengths, rank, world, batch_size=2, shard_tokens=10) for b in shard for r in b]
            for rank in range(world)]
    assert sorted(r for rank_rows in rows for r in rank_rows) == list(range(len(lengths)))
    for rank in range(world):
        batches = [b for shard in plan_shards(lengths, rank, world, 2, 10) for b in shard]
        flat = [r for b in batches for r in b]
        assert [lengths[r] for r in flat] == sorted((lengths[r] for r in flat), reverse=True)  # little padding
        assert all(len(b) <= 2 for b in batches)


@pytest.mark.slow  # ~75 s on the shared 2-core machine: two processes import torch, transformers, deepspeed
def test_two_processes_write_disjoint_shards_covering_everything(tmp_path):
    pytest.importorskip("accelerate")
    target = build_tiny_target(tmp_path / "target")
    recipe = make_recipe(tmp_path / "run", target, n_train=15, n_val=5)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(dump_recipe(recipe))
    script = tmp_path / "collect_main.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MASTER_PORT="29517")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
           str(script), str(recipe_file)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    features = recipe.stage_dir("features")
    index = json.loads((features / "index.json").read_text())
    assert index["num_processes"] == 2
    for split, n in (("train", 15), ("validation", 5)):
        rows_of_rank = {0: [], 1: []}
        for entry in index["splits"][split]["shards"]:
            rank = int(entry["file"].split("/")[1][1:4])
            ds_rows = FeatureDataset.shard_rows(features / entry["file"])
            rows_of_rank[rank] += ds_rows
        assert rows_of_rank[0] and rows_of_rank[1], "both ranks wrote shards"
        assert not set(rows_of_rank[0]) & set(rows_of_rank[1]), "a sample was collected by both ranks"
        assert sorted(rows_of_rank[0] + rows_of_rank[1]) == list(range(n))
        store = FeatureDataset(features, split, verify=True)
        assert [int(store[i]["sample_index"]) for i in range(len(store))] == list(range(n))
    assert (features / "DONE.json").exists()
