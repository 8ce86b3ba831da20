"""`eyas collect`: store the target's features of the train and validation splits under features/.

The store's format, its reader and the online computation are the library in data/features.py; this
module is the stage that writes a store:

    features/{train,validation}/progress.rRRR.json   what each rank finished (resume)
    features/inputs.json                             the inputs the store was begun with
    features/index.json                              written last, once every shard is in

Each rank (accelerate) takes every world-th sample of the split sorted by length, writes its own shards
(temp name, fsync, os.replace, then its progress file atomically); rank 0 merges the index. A killed run
resumes: shards whose checksum holds are kept. DONE.json is the stage runner's (data/stage.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes
from tqdm.auto import tqdm

from eyas.data.atomic import atomic_write_bytes, atomic_write_json
from eyas.data.config import CollectConfig
from eyas.data.features import (FORMAT, INDEX, SPLITS, TEACHER, FeatureStoreError, OnlineFeatures, bytes_per_token,
                                check_config, collate, load_splits, read_json, sha256_bytes, shard_name,
                                verify_shards)
from eyas.data.stage import code_version, done_hash, hash_json
from eyas.data.targets import Target
from eyas.data.vocab import load_vocab

STARTED = "inputs.json"
# The code that decides what a shard holds: a store begun by other code is stale.
STORE_CODE = ("eyas.data.collect", "eyas.data.features")
DISK_MARGIN = 64 << 20  # room for the temp copy of a shard and the index


# ---- planning and writing shards ---------------------------------------------------------------------------

def plan_shards(lengths: list[int], rank: int, world: int, batch_size: int,
                shard_tokens: int) -> list[list[list[int]]]:
    """Shards -> batches -> sample rows for one rank: samples sorted by length (longest first, so padding is
    small and memory peaks early), every world-th to this rank, batches of batch_size, shards of ~shard_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[rank::world]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    shards, current, tokens = [], [], 0
    for batch in batches:
        current.append(batch)
        tokens += sum(lengths[i] for i in batch)
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


def progress_path(out: Path, split: str, rank: int) -> Path:
    return out / split / f"progress.r{rank:03d}.json"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    data = safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": FORMAT})
    atomic_write_bytes(path, data)
    # The write time lets readers skip the checksum of an untouched shard (data/features.verify_shards).
    return {"sha256": sha256_bytes(data), "bytes": len(data), "mtime_ns": path.stat().st_mtime_ns}


def batch_tokens(split_ds, rows: list[int], where: str, vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """input_ids/loss_mask of some rows of the prepared split, checked."""
    records = split_ds[rows]
    record_ids = records.get("record_id") or rows
    samples = []
    for row, rid, ids, mask in zip(rows, record_ids, records["input_ids"], records["loss_mask"]):
        if not ids:
            raise FeatureStoreError(f"{where}: record {rid} (row {row}): field 'input_ids' is empty")
        if len(mask) != len(ids):
            raise FeatureStoreError(f"{where}: record {rid} (row {row}): field 'loss_mask' has {len(mask)} "
                                    f"values, 'input_ids' has {len(ids)}")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise FeatureStoreError(f"{where}: record {rid} (row {row}): field 'input_ids' holds id "
                                    f"{max(ids) if max(ids) >= vocab_size else min(ids)} outside the target "
                                    f"vocabulary [0, {vocab_size}); was the data prepared with another tokenizer?")
        samples.append({"input_ids": torch.tensor(ids, dtype=torch.int32),
                        "loss_mask": torch.tensor(mask, dtype=torch.uint8)})
    return samples


def collect_shard(features: OnlineFeatures, split_ds, batches: list[list[int]], where: str, bar) -> dict:
    """Run the target over one shard's batches; return the flat tensors of the shard."""
    parts: dict[str, list[torch.Tensor]] = {}
    rows, lengths = [], []
    for batch_rows in batches:
        samples = batch_tokens(split_ds, batch_rows, where, features.t2d.numel())
        stored = {k: v.cpu() for k, v in features.encode(collate(samples)).items()}
        for i, sample in enumerate(samples):
            n = len(sample["input_ids"])
            for name, value in [*sample.items(), *stored.items()]:
                parts.setdefault(name, []).append(value[i, :n] if name in stored else value)
            lengths.append(n)
        rows += batch_rows
        bar.update(sum(len(s["input_ids"]) for s in samples))
    tensors = {name: torch.cat(values) for name, values in parts.items()}
    tensors["offsets"] = torch.tensor([0] + lengths).cumsum(0)
    tensors["sample_index"] = torch.tensor(rows, dtype=torch.int64)
    return tensors


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_disk(out: Path, need: int, per_token: int, tokens: int) -> None:
    gb = 1 << 30
    print(f"[collect] storage: {per_token} bytes/token, {tokens:,} tokens to collect -> {need / gb:.3f} GiB "
          f"({need:,} bytes) under {out}", flush=True)
    free = _free_bytes(out)
    if free < need + DISK_MARGIN:
        raise FeatureStoreError(
            f"not enough disk for the feature store in {out}: needs {need / gb:.2f} GiB ({per_token} bytes/token x "
            f"{tokens:,} tokens) + {DISK_MARGIN >> 20} MiB margin, only {free / gb:.2f} GiB free. Fix: free space, "
            f"or store less: collect.feature_dtype=float8_e4m3, collect.teacher=topk, collect.max_records=N, "
            f"or collect.mode=online (no storage)")


# ---- the stage ------------------------------------------------------------------------------------------------

def collect(cfg: CollectConfig, target: Target, data_dir: Path, vocab_dir: Path, out: Path) -> dict | None:
    """Fill `out` with the features of the prepared splits in `data_dir` under the draft vocab in `vocab_dir`.

    Online mode stores nothing (the trainer runs the target itself). Returns the figures for DONE."""
    check_config(cfg)
    state = process_state(target)
    if cfg.mode == "online":
        if state.is_main_process:
            print("[collect] mode=online: nothing stored, the trainer runs the target (OnlineFeatures)", flush=True)
        state.wait_for_everyone()
        return {"mode": "online"}
    rank, world = state.process_index, state.num_processes
    key = hash_json({"collect": cfg, "target": target.cfg, "target_hash": target.hash, "data": done_hash(data_dir),
                     "vocab": done_hash(vocab_dir), "code": code_version(STORE_CODE), "num_processes": world})
    begin_store(out, key, world, state)

    vocab = load_vocab(vocab_dir)
    splits = load_splits(data_dir, cfg.max_records)
    per_token = bytes_per_token(target.config.hidden_size, cfg, vocab[0].numel())
    lengths = {split: sample_lengths(ds) for split, ds in splits.items()}
    plans = {split: [plan_shards(lengths[split], r, world, cfg.batch_size, cfg.shard_tokens) for r in range(world)]
             for split in splits}
    finished = check_space(out, plans, lengths, per_token, rank, state.is_main_process)

    device = state.device if target.cfg.device == "auto" else target.cfg.device
    model = target.load_model(device)
    features = OnlineFeatures(model, vocab, cfg, target.aux_layer_ids)
    if state.is_main_process:
        write_teacher(out, features)
    for split, ds in splits.items():
        collect_split(out, split, ds, lengths[split], plans[split][rank], finished[split], features, rank,
                      state, where=f"{data_dir} ({split} split)")
    state.wait_for_everyone()

    if state.is_main_process:
        index = merge_index(out, plans, world)
        index.update({
            "teacher": cfg.teacher, "feature_dtype": cfg.feature_dtype, "topk": cfg.topk if cfg.teacher == "topk" else None,
            "topk_dtype": cfg.topk_dtype if cfg.teacher == "topk" else None,
            "hidden_size": features.hidden_size, "aux_layer_ids": features.layer_ids,
            "draft_vocab_size": features.draft_vocab_size, "target_vocab_size": int(vocab[1].numel()),
            "target": target.name, "target_hash": target.hash,
            "target_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "bytes_per_token": per_token, "num_processes": world, "inputs_hash": key,
            "positions": "unshifted: aux/teacher at t belong to token t; the trainer shifts",
        })
        atomic_write_json(out / INDEX, index)
        print(f"[collect] wrote {out}", flush=True)
    state.wait_for_everyone()
    return {"mode": "offline", "num_processes": world,
            "tokens": {split: sum(lengths[split]) for split in splits}}


def process_state(target: Target):
    """accelerate's PartialState: this process's rank and device in an `accelerate launch` (or alone)."""
    from accelerate import PartialState

    # PartialState does not read ACCELERATE_USE_CPU itself; without cpu=True, CPU processes would not join a group.
    use_cpu = (os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
               or target.cfg.device == "cpu" or not torch.cuda.is_available())
    return PartialState(cpu=use_cpu)


def begin_store(out: Path, key: str, world: int, state) -> None:
    """Start over when `out` holds a store begun with other inputs (or by another number of processes)."""
    started = out / STARTED
    if state.is_main_process:
        stamp = {"hash": key, "num_processes": world}
        if out.exists() and (not started.exists() or read_json(started) != stamp):
            print(f"[collect] {out} holds features of other inputs; starting over", flush=True)
            for entry in out.iterdir():  # everything but the run's own folder locks (data/stage.py)
                if not entry.name.startswith(".lock."):
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        for split in SPLITS:
            (out / split).mkdir(parents=True, exist_ok=True)
            for tmp in (out / split).glob(".*.tmp-*"):
                tmp.unlink()  # leftovers of a killed write
        atomic_write_json(started, stamp)
    state.wait_for_everyone()


def check_space(out: Path, plans: dict, lengths: dict, per_token: int, rank: int, main: bool) -> dict:
    """The shards this rank already finished, per split; refuse when the disk cannot hold the rest."""
    finished = {}
    need_tokens = need_samples = 0
    for split, rank_plans in plans.items():
        for r, plan in enumerate(rank_plans):
            # Each rank checksums only its own shards; the others' progress is only counted.
            done = read_progress(out, split, r, plan, verify=r == rank)
            if r == rank:
                finished[split] = done
            for n, shard in enumerate(plan):
                if shard_name(split, r, n) not in done:
                    need_tokens += sum(lengths[split][i] for b in shard for i in b)
                    need_samples += sum(len(b) for b in shard)
    need = need_tokens * per_token + 16 * need_samples
    # Every rank computes the same figure, so all refuse together (no rank left waiting at a barrier).
    if main:
        check_disk(out, need, per_token, need_tokens)
    elif _free_bytes(out) < need + DISK_MARGIN:
        raise FeatureStoreError(f"not enough disk for the feature store in {out} (see rank 0's message)")
    return finished


def sample_lengths(ds, chunk: int = 65536) -> list[int]:
    """Token count of every row, read through Arrow (no Python lists of all the ids)."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")
    lengths: list[int] = []
    for start in range(0, len(ds), chunk):
        lengths += pc.list_value_length(table[start:start + chunk]["input_ids"]).to_pylist()
    return lengths


def write_teacher(out: Path, features: OnlineFeatures) -> None:
    tensors = {"d2t": features.d2t.contiguous()}
    if features.cfg.teacher == "last_hidden":
        tensors["lm_head_rows"] = features.teacher().rows.cpu().contiguous()
    meta = {"softcap": str(features.softcap or "none"), "draft_vocab_size": str(features.draft_vocab_size),
            "teacher": features.cfg.teacher}
    atomic_write_bytes(out / TEACHER, safetensors_bytes(tensors, metadata=meta))


def read_progress(out: Path, split: str, rank: int, plan, verify: bool = True) -> dict:
    """Shards a rank finished, verified against their checksums; bad ones are dropped (recollected)."""
    path = progress_path(out, split, rank)
    if not path.exists():
        return {}
    progress = read_json(path)
    if progress.get("plan") != plan_digest(plan):
        raise FeatureStoreError(f"{path}: field 'plan' does not match this run's shard plan; "
                                f"delete {out} and rerun")
    finished = {}
    for name, entry in progress["shards"].items():
        try:
            verify_shards(out, [entry], checksum=verify)
        except FeatureStoreError as exc:
            print(f"[collect] {exc}; collecting it again", flush=True)
            continue
        finished[name] = entry
    return finished


def plan_digest(plan) -> str:
    return sha256_bytes(json.dumps(plan).encode())[:16]


def collect_split(out: Path, split: str, ds, lengths: list[int], plan, finished: dict, features: OnlineFeatures,
                  rank: int, state, where: str) -> None:
    todo = [(n, shard) for n, shard in enumerate(plan) if shard_name(split, rank, n) not in finished]
    tokens = sum(lengths[i] for _, shard in todo for b in shard for i in b)
    progress = {"plan": plan_digest(plan), "shards": dict(finished)}
    with tqdm(total=tokens, unit="tok", unit_scale=True, desc=f"collect {split} r{rank}",
              disable=not state.is_local_main_process) as bar:
        for n, shard in todo:
            tensors = collect_shard(features, ds, shard, where, bar)
            name = shard_name(split, rank, n)
            entry = write_shard(out / name, tensors)
            entry.update(file=name, samples=int(tensors["sample_index"].numel()), tokens=int(tensors["offsets"][-1]))
            progress["shards"][name] = entry
            atomic_write_json(progress_path(out, split, rank), progress)


def merge_index(out: Path, plans: dict, world: int) -> dict:
    index = {"format": FORMAT, "splits": {}}
    for split, rank_plans in plans.items():
        shards = []
        for r in range(world):
            progress = read_json(progress_path(out, split, r)) if progress_path(out, split, r).exists() \
                else {"shards": {}}
            for n in range(len(rank_plans[r])):
                name = shard_name(split, r, n)
                if name not in progress["shards"]:
                    raise FeatureStoreError(f"{progress_path(out, split, r)}: shard {name} was not written")
                shards.append(progress["shards"][name])
        index["splits"][split] = {"num_samples": sum(s["samples"] for s in shards),
                                  "num_tokens": sum(s["tokens"] for s in shards), "shards": shards}
    return index
