"""Resuming a run: head/state/ (accelerate's state + progress.json), its key, and the metrics log it trims."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eyas.data.atomic import atomic_dir_write, atomic_write_json, atomic_write_text
from eyas.data.config import CollectConfig
from eyas.data.stage import done_hash, hash_json
from eyas.data.targets import Target
from eyas.heads.config import HeadConfig
from eyas.train.config import TrainConfig
from eyas.train.data import TrainPaths

STATE = "state"
PROGRESS = "progress.json"


def resume_key(cfg: TrainConfig, head_cfg: HeadConfig, collect_cfg: CollectConfig, target: Target,
               paths: TrainPaths) -> str:
    """What a saved state was trained on: the configs, the target and the DONE hashes of the inputs."""
    return hash_json({"train": cfg, "head": head_cfg, "collect": collect_cfg, "target": target.cfg,
                      "target_hash": target.hash,
                      "upstream": {name: done_hash(getattr(paths, name)) for name in ("data", "vocab", "features")}})


def save_state(accelerator, head_dir: Path, progress: dict) -> None:
    """head/state/: accelerate's state (every rank writes its part) + progress.json, swapped in when complete."""
    from accelerate.utils import broadcast_object_list

    def fill(where: list) -> None:
        # atomic_dir_write names its temporary folder after rank 0's pid: the other ranks learn it from rank 0.
        broadcast_object_list(where)
        accelerator.save_state(where[0])
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            atomic_write_json(Path(where[0]) / PROGRESS, progress)

    if accelerator.is_main_process:
        for stale in head_dir.glob(f".{STATE}.tmp-*"):  # a killed run's half-written state
            shutil.rmtree(stale, ignore_errors=True)
        atomic_dir_write(head_dir / STATE, lambda tmp: fill([str(tmp)]))
        for stale in head_dir.glob(f".{STATE}.old-*"):
            shutil.rmtree(stale, ignore_errors=True)
    else:
        fill([None])
    accelerator.wait_for_everyone()


def find_state(head_dir: Path) -> Path | None:
    """The last complete state (a kill between atomic_dir_write's two renames leaves it under .state.old-*)."""
    for path in (head_dir / STATE, *sorted(head_dir.glob(f".{STATE}.old-*"))):
        if (path / PROGRESS).exists():
            return path
    return None


def resume(accelerator, head_dir: Path, progress: dict) -> dict:
    """The saved progress, with accelerate's state loaded, when head/ holds a state of the same run; else `progress`."""
    state_dir = find_state(head_dir)
    if state_dir is None:
        return progress
    saved = json.loads((state_dir / PROGRESS).read_text())
    same = ("inputs_hash", "global_batch", "num_processes")
    if all(saved.get(k) == progress[k] for k in same):
        accelerator.load_state(str(state_dir))
        if accelerator.is_main_process:
            print(f"[train] resuming from {state_dir} at step {saved['step']}", flush=True)
        return saved
    if accelerator.is_main_process:
        print(f"[train] {state_dir} belongs to other inputs or another layout; starting over", flush=True)
    return progress


def trim_metrics(path: Path, step: int) -> None:
    """Drop metrics logged after the resumed step (they are recomputed, identically)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def append_metrics(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
