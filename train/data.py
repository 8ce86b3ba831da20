"""What the trainer reads: the feature store or the target in the loop, and which samples each step takes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.data.config import CollectConfig
from eyas.data.features import INDEX, SPLITS, TEACHER, FeatureDataset, OnlineFeatures, PreparedRows, Teacher, collate, load_splits
from eyas.data.targets import Target
from eyas.train.loss import BatchTeacher


class TrainingError(RuntimeError):
    """Training cannot go on (bad input or a non-finite loss); the message says where and what to do."""


@dataclass
class TrainPaths:
    """The folders training reads (data, vocab, features) and the one it writes (head)."""

    data: Path
    vocab: Path
    features: Path
    head: Path


class Features:
    """Turns collated micro-batches into (loss batch, teacher) on the device: read from the store, or the
    target run in the loop (online). Both give the same numbers (OnlineFeatures rounds like storage)."""

    def __init__(self, cfg: CollectConfig, target: Target, paths: TrainPaths, vocab: tuple[torch.Tensor, torch.Tensor],
                 device: torch.device):
        self.device = device
        if cfg.mode == "offline":
            self.datasets = {s: FeatureDataset(paths.features, s) for s in SPLITS}
            self.teacher = Teacher.load(paths.features, device)
            check_store(paths.features, self.datasets["train"].meta, self.teacher, target, vocab)
            self.online = None
        elif cfg.mode == "online":
            self.online = OnlineFeatures(target.load_model(device), vocab, cfg, target.aux_layer_ids)
            self.teacher = self.online.teacher()
            self.datasets = {s: PreparedRows(ds) for s, ds in load_splits(paths.data, cfg.max_records).items()}
        else:
            raise TrainingError(f"collect.mode must be offline or online, got '{cfg.mode}'")

    def __call__(self, collated: dict) -> tuple[dict, BatchTeacher]:
        batch = {k: v.to(self.device) for k, v in collated.items()}
        if self.online is not None:
            batch = self.online(batch)
        return batch, BatchTeacher(self.teacher, batch)

    def batch(self, split: str, rows: list[int]) -> tuple[dict, BatchTeacher]:
        return self(collate([self.datasets[split][i] for i in rows]))


def check_store(features_dir: Path, meta: dict, teacher: Teacher, target: Target, vocab) -> None:
    """Refuse a feature store collected for another target, aux layers or draft vocabulary."""
    expected = {"aux_layer_ids": target.aux_layer_ids, "draft_vocab_size": int(vocab[0].numel()),
                "target_hash": target.hash}
    for field, want in expected.items():
        if field in meta and meta[field] != want:
            raise TrainingError(f"{features_dir / INDEX}: field '{field}' is {meta[field]!r}, this recipe "
                                f"needs {want!r}. Fix: rerun `eyas collect <recipe>`")
    # Same size is not the same vocabulary: the stored teacher is indexed by the draft ids it was built with.
    if teacher.d2t is None or not torch.equal(teacher.d2t.cpu(), vocab[0].cpu()):
        differ = "no d2t" if teacher.d2t is None else \
            f"{int((teacher.d2t.cpu() != vocab[0].cpu()).sum())} of {vocab[0].numel()} draft ids map elsewhere"
        raise TrainingError(f"{features_dir / TEACHER}: field 'd2t' differs from the vocab stage's ({differ}): "
                            "the store was collected with another draft vocabulary. Fix: rerun `eyas collect <recipe>`")


class Plan:
    """Which samples each rank's micro-batches hold at every optimizer step (see the module docstring)."""

    def __init__(self, num_samples: int, batch_size: int, grad_accum: int, world: int, rank: int, seed: int):
        self.n, self.bs, self.accum, self.world, self.rank, self.seed = \
            num_samples, batch_size, grad_accum, world, rank, seed
        self.global_batch = batch_size * grad_accum * world
        self.steps_per_epoch = num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise TrainingError(f"the training split has {num_samples} samples, fewer than one global batch "
                                f"({batch_size} x grad_accum {grad_accum} x {world} processes)")
        self._perm_epoch, self._perm = None, None

    def micro_batches(self, step: int) -> list[list[int]]:
        epoch, s = divmod(step, self.steps_per_epoch)
        if self._perm_epoch != epoch:
            self._perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
            self._perm_epoch = epoch
        chunk = self._perm[s * self.global_batch:(s + 1) * self.global_batch]
        slots = [m * self.world + self.rank for m in range(self.accum)]
        return [chunk[i * self.bs:(i + 1) * self.bs] for i in slots]


def validation_batches(n: int, batch_size: int, world: int, rank: int, max_batches: int | None) -> list[list[int]]:
    """The same number of batches on every rank (sharded models need matching forward calls)."""
    per_rank = n // (batch_size * world)
    if max_batches is not None:
        per_rank = min(per_rank, max_batches)
    return [list(range((i * world + rank) * batch_size, (i * world + rank + 1) * batch_size)) for i in range(per_rank)]
