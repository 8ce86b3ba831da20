"""The stage contract: what every pipeline stage (prepare, vocab, collect, train, bench) shares.

A stage writes into its own folder under the recipe's output_dir and, last of all, `DONE.json` with
the hash of everything it read: its config sections, the input hashes of the stages upstream of it,
extra inputs it names (corpus files, a head's weights) and the source of the code that computes it.
A stage whose DONE matches is up to date and is skipped; a changed input, or a changed line of the
code that produces it, redoes that stage and, through the hashes, every stage after it.

The stages themselves live with their folders (data/, train/, eval/); `eyas.stages` lists them, each
with its sections, upstream stages and run function, and `eyas run` walks that list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from eyas.data.atomic import atomic_write_json

DONE = "DONE.json"


def read_done(folder: str | Path) -> dict | None:
    """The DONE record of a stage folder, or None when the stage has not finished there."""
    try:
        return json.loads((Path(folder) / DONE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def done_hash(folder: str | Path) -> str | None:
    """input_hash of a stage folder's DONE (None when the stage has not finished there)."""
    done = read_done(folder)
    return done.get("input_hash") if done else None


def write_done(folder: str | Path, input_hash: str, **extra) -> Path:
    return atomic_write_json(Path(folder) / DONE, {"input_hash": input_hash, "finished": time.time(), **extra})


def hash_json(obj: Any, length: int = 16) -> str:
    """Short content hash of a JSON-able value (dataclasses become dicts)."""
    blob = json.dumps(obj, sort_keys=True, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o)
                      else str(o))
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def code_version(modules: tuple[str, ...] | list[str]) -> str:
    """Hash of the source files of `modules`, so a change to the code of a stage redoes it."""
    digest = hashlib.sha256()
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise ModuleNotFoundError(f"stage code module '{name}' not found")
        digest.update(name.encode())
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


def is_main_process() -> bool:
    """Rank 0 of an `accelerate launch` (or the only process): the one that writes DONE."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, declared once.

    `run(recipe, target, out)` fills the stage folder `out` and returns a few figures for DONE; it is an
    adapter that hands the stage function its own config sections, the resolved target and its paths,
    so no stage sees the whole recipe. `inputs(recipe)` names inputs that are not config sections
    (corpus files, a head's weights).
    """

    name: str
    folder: str
    sections: tuple[str, ...]
    upstream: tuple[str, ...]
    code: tuple[str, ...]
    run: Callable[..., Any]
    inputs: Callable[..., dict] | None = None
    # Stages that compute nothing worth caching (the gate reads one JSON) always run.
    cached: bool = True
    # A stage that only runs when the recipe asks for it (`enabled(recipe)` false: skipped, nothing written).
    enabled: Callable[..., bool] | None = None


def input_hash(stage: Stage, sections: dict[str, Any], upstream: dict[str, Path], extra: dict | None) -> str:
    """The hash DONE records: config sections, upstream stages' own hashes, extra inputs, code."""
    missing = [name for name, folder in upstream.items() if done_hash(folder) is None]
    if missing:
        raise FileNotFoundError(f"{upstream[missing[0]] / DONE} does not exist: stage '{stage.name}' needs "
                                f"{', '.join(missing)} first; run `eyas {missing[0]} <recipe>` (or `eyas run <recipe>`)")
    return hash_json({"stage": stage.name, "sections": sections,
                      "upstream": {name: done_hash(folder) for name, folder in upstream.items()},
                      "inputs": extra or {}, "code": code_version(stage.code)})


class StageLockedError(RuntimeError):
    """Another run is writing the same stage folder."""


@contextmanager
def folder_lock(out: Path, stage: str) -> Iterator[None]:
    """Hold an exclusive lock on `out` while a stage writes it; a second run is refused, naming the holder.

    One lock file per rank, so two launches with the same ranks collide on every rank. The kernel drops
    the lock when its process dies, so a killed run never leaves a stale lock behind.
    """
    import fcntl
    import socket

    out.mkdir(parents=True, exist_ok=True)
    path = out / f".lock.rank{os.environ.get('RANK', '0')}"
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise StageLockedError(f"{out} is being written by {holder} (stage '{stage}'); wait for it to finish "
                               "or stop it, then rerun") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    handle.flush()
    try:
        yield
    finally:
        handle.close()  # releases the lock; the file stays (removing it would race with a waiting run)


def run_stage(stage: Stage, out: Path, key: str, work: Callable[[], dict | None]) -> Path:
    """Skip when `out` holds a DONE with `key`; else clear DONE, do `work()`, then write DONE (rank 0).

    `work()` fills `out` and returns a few figures worth keeping in DONE (or None). The folder is locked
    meanwhile, so two runs never interleave their writes in one folder."""
    if done_hash(out) == key:
        if is_main_process():
            print(f"[{stage.name}] {out} is up to date ({DONE} matches its inputs)", flush=True)
        return out
    with folder_lock(out, stage.name):
        if is_main_process():
            (out / DONE).unlink(missing_ok=True)
        extra = work() or {}
        if is_main_process():
            write_done(out, key, stage=stage.name, **extra)
    return out
