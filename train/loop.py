"""`run_train(recipe)`: train the EAGLE-3 head with training-time test, one readable loop under accelerate.

    head/best, head/last       native heads (heads/checkpoint.py), written atomically
    head/state/                optimizer, scheduler, RNG (accelerate) + progress.json (data position) for resume
    head/metrics.jsonl         one JSON per log / validation
    head/training.png          validation accuracy per TTT step and tau_sim over training
    head/DONE.json             input hashes, written last

Data order is a pure function of (seed, epoch): step s of an epoch takes the s-th global batch of a seeded
permutation; rank r's micro-batch m of it is slot m*world + r. So one process with grad_accum=W sees the same
samples per optimizer step as W processes with grad_accum=1, and resume needs only the step number.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from eyas.data import collect
from eyas.data.prepare import write_done
from eyas.data.vocab import load_vocab
from eyas.data.targets import aux_layer_ids_for, resolve_target, target_hash, text_config, tokenizer_hash
from eyas.heads.checkpoint import save_head
from eyas.heads.eagle3 import Eagle3Config, Eagle3Head, build_head
from eyas.train.config import TrainConfig
from eyas.train.loss import BatchTeacher, summarise, ttt_loss

STATE = "state"
PROGRESS = "progress.json"
METRICS = "metrics.jsonl"


class TrainingError(RuntimeError):
    """Training cannot go on (bad input or a non-finite loss); the message says where and what to do."""


# ---- the model accelerate wraps --------------------------------------------------------------------------

class TTTModel(nn.Module):
    """The head plus its loss in forward(), so DDP/FSDP/DeepSpeed see one module call per micro-batch."""

    def __init__(self, head: Eagle3Head, ttt_steps: int, step_weight_decay: float):
        super().__init__()
        self.head = head
        self.ttt_steps = ttt_steps
        self.step_weight_decay = step_weight_decay

    def forward(self, batch: dict, teacher, embed_weight: torch.Tensor):
        batch = dict(batch, aux=batch["aux"].to(self.head.fc.weight.dtype))
        out = ttt_loss(self.head, embed_weight, batch, teacher, self.ttt_steps, self.step_weight_decay)
        return out.loss, out.counters()


# ---- setup ----------------------------------------------------------------------------------------------------

def resolve_mixed_precision(name: str) -> str:
    """accelerate's mixed_precision: "auto" is bf16 where the device computes bf16 fast, else fp32 ("no")."""
    if name not in ("auto", "no", "fp32", "bf16", "fp16"):
        raise TrainingError(f"train.mixed_precision must be auto, fp32 (or 'no', quoted in YAML), bf16 or fp16, "
                            f"got '{name}'")
    if name == "fp32":
        return "no"
    if name == "fp16" and not torch.cuda.is_available():
        raise TrainingError("train.mixed_precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_bf16_is_fast() else "no"


def cpu_bf16_is_fast(n: int = 256) -> bool:
    """Whether this CPU multiplies bf16 at least as fast as fp32. With AMX/AVX512-BF16 it is ~2x faster; without,
    oneDNN emulates it (measured 0.9 vs 51 GFLOP/s fp32 on a 2-core machine), so autocast would be a 50x loss."""
    import time

    def best(dtype) -> float:
        a = torch.randn(n, n).to(dtype)
        a @ a
        times = []
        for _ in range(3):
            t = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t)
        return min(times)

    return best(torch.bfloat16) <= best(torch.float32)


def make_accelerator(cfg: TrainConfig, head_dir: Path):
    from accelerate import Accelerator, InitProcessGroupKwargs

    handlers = []
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # On CPU, every backend (incl. DeepSpeed's) must be gloo, or ranks silently train on the same batches.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    trackers = [t for t in cfg.trackers if t != "none"]
    if "wandb" in trackers:  # offline unless the user chose otherwise; its files go under head/
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(head_dir))
    # The scheduler steps once per optimizer step, by hand (accelerate would step it once per process).
    return Accelerator(mixed_precision=resolve_mixed_precision(cfg.mixed_precision),
                       gradient_accumulation_steps=cfg.grad_accum, log_with=trackers or None,
                       project_dir=str(head_dir), kwargs_handlers=handlers, step_scheduler_with_optimizer=False)


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding [V, H], read from its safetensors without loading the model."""
    from safetensors import safe_open

    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            names = [k for k in fh.keys() if k.endswith("embed_tokens.weight")]
            if names:
                return fh.get_tensor(sorted(names, key=len)[0])
    raise TrainingError(f"{target_dir}: no '*embed_tokens.weight' tensor in its safetensors files")


def build_training_head(recipe, target_config, vocab: tuple[torch.Tensor, torch.Tensor]) -> Eagle3Head:
    h = recipe.head
    config = Eagle3Config.from_target(
        target_config, draft_vocab_size=vocab[0].numel(),
        aux_layer_ids=aux_layer_ids_for(target_config, recipe.target), hidden_size=h.hidden_size,
        intermediate_size=h.intermediate_size, num_attention_heads=h.num_attention_heads,
        num_key_value_heads=h.num_key_value_heads)
    seed_everything(recipe.train.seed)
    head = build_head(config)
    head.set_vocab(*vocab)
    return head


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ---- data -----------------------------------------------------------------------------------------------------

class PreparedRows(torch.utils.data.Dataset):
    """Rows of the prepared split as {input_ids, loss_mask, sample_index} (online mode)."""

    def __init__(self, split_ds):
        self.ds = split_ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[i]
        return {"input_ids": torch.tensor(row["input_ids"]), "loss_mask": torch.tensor(row["loss_mask"]),
                "sample_index": torch.tensor(i)}


class Features:
    """Turns collated micro-batches into (loss batch, teacher) on the device: read from the store, or the
    target run in the loop (online). Both give the same numbers (collect.OnlineFeatures rounds like storage)."""

    def __init__(self, recipe, vocab: tuple[torch.Tensor, torch.Tensor], device: torch.device):
        self.mode = recipe.collect.mode
        self.device = device
        if self.mode == "offline":
            features_dir = recipe.stage_dir("features")
            self.datasets = {s: collect.FeatureDataset(features_dir, s) for s in collect.SPLITS}
            check_store(features_dir, self.datasets["train"].meta, recipe, vocab)
            self.teacher = collect.Teacher.load(features_dir, device)
            self.online = None
        elif self.mode == "online":
            from eyas.data.targets import load_target

            model, _ = load_target(recipe.target, device=device)
            self.online = collect.OnlineFeatures(model, vocab, recipe.collect, aux_layer_ids_for(model, recipe.target))
            self.teacher = self.online.teacher()
            splits = collect.load_splits(recipe.stage_dir("data"), recipe.collect.max_records)
            self.datasets = {s: PreparedRows(ds) for s, ds in splits.items()}
        else:
            raise TrainingError(f"collect.mode must be offline or online, got '{self.mode}'")

    def __call__(self, collated: dict) -> tuple[dict, BatchTeacher]:
        batch = {k: v.to(self.device) for k, v in collated.items()}
        if self.online is not None:
            batch = self.online(batch)
        return batch, BatchTeacher(self.teacher, batch)


def check_store(features_dir: Path, meta: dict, recipe, vocab) -> None:
    """Refuse a feature store collected for another target, aux layers or draft vocabulary."""
    from transformers import AutoConfig

    target_dir = resolve_target(recipe.target.name_or_path)
    expected = {"aux_layer_ids": aux_layer_ids_for(AutoConfig.from_pretrained(target_dir), recipe.target),
                "draft_vocab_size": int(vocab[0].numel()), "target_hash": target_hash(recipe.target.name_or_path)}
    for field, want in expected.items():
        if field in meta and meta[field] != want:
            raise TrainingError(f"{features_dir / collect.INDEX}: field '{field}' is {meta[field]!r}, this recipe "
                                f"needs {want!r}. Fix: rerun `eyas collect <recipe>`")


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


# ---- checkpoints and state ----------------------------------------------------------------------------------

def full_head(accelerator, model, config: Eagle3Config) -> Eagle3Head | None:
    """A CPU fp32 copy of the trained head on the main process (gathers sharded weights on every rank)."""
    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return None
    head = Eagle3Head(config)
    weights = {k.removeprefix("head."): v.float().cpu() for k, v in state.items()}
    head.load_state_dict(weights, strict=True)
    return head


def save_state(accelerator, head_dir: Path, progress: dict) -> None:
    """head/state/: accelerate's state (all ranks) + progress.json, swapped in only when complete."""
    tmp, final, old = head_dir / f".{STATE}.tmp", head_dir / STATE, head_dir / f".{STATE}.old"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        collect.write_json_atomic(tmp / PROGRESS, progress)
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def find_state(head_dir: Path) -> Path | None:
    """The last complete state (a kill between the two renames leaves it under .state.old)."""
    for path in (head_dir / STATE, head_dir / f".{STATE}.old"):
        if (path / PROGRESS).exists():
            return path
    return None


def trim_metrics(path: Path, step: int) -> None:
    """Drop metrics logged after the resumed step (they are recomputed, identically)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    collect.write_atomic(path, "".join(line + "\n" for line in keep).encode())


def append_metrics(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def inputs_hash(recipe) -> str:
    import hashlib

    upstream = {"vocab": collect.upstream_hash(recipe.stage_dir("vocab")),
                "features": collect.upstream_hash(recipe.stage_dir("features")),
                "data": collect.upstream_hash(recipe.stage_dir("data"))}
    parts = {"sections": recipe.section_hash("target", "vocab", "collect", "head", "train"), "upstream": upstream}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# ---- validation ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(accelerator, model, features: Features, embed_weight, cfg: TrainConfig) -> dict:
    dataset = features.datasets["validation"]
    batches = validation_batches(len(dataset), cfg.batch_size, accelerator.num_processes,
                                 accelerator.process_index, cfg.eval_max_batches)
    if not batches:
        raise TrainingError(f"the validation split has {len(dataset)} samples, fewer than one batch per process "
                            f"({cfg.batch_size} x {accelerator.num_processes})")
    model.eval()
    total = torch.zeros(3 * cfg.ttt_steps + 2, dtype=torch.float64, device=accelerator.device)
    for rows in batches:
        batch, teacher = features(collect.collate([dataset[i] for i in rows]))
        _, counters = model(batch, teacher, embed_weight)
        total += counters.to(total.device)
    model.train()
    return summarise(accelerator.reduce(total, reduction="sum").cpu(), cfg.ttt_steps)


# ---- the loop ---------------------------------------------------------------------------------------------------

def run_train(recipe) -> Path:
    """Train the head of `recipe`; returns head/best."""
    from transformers import AutoConfig

    cfg: TrainConfig = recipe.train
    head_dir = recipe.stage_dir("head")
    head_dir.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(cfg, head_dir)
    main = accelerator.is_main_process
    device = accelerator.device
    if main:
        print(f"[train] {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
              f"mixed precision {accelerator.mixed_precision}, device {device}, collect mode {recipe.collect.mode}",
              flush=True)

    target_dir = Path(resolve_target(recipe.target.name_or_path))
    target_config = text_config(AutoConfig.from_pretrained(target_dir, trust_remote_code=recipe.target.trust_remote_code))
    vocab = load_vocab(recipe.stage_dir("vocab"))
    features = Features(recipe, vocab, device)
    embed_weight = load_target_embedding(target_dir).to(device)
    if embed_weight.shape[0] != vocab[1].numel():
        raise TrainingError(f"{recipe.stage_dir('vocab')}: vocabulary built for {vocab[1].numel()} target "
                            f"tokens, the target's embedding has {embed_weight.shape[0]} rows")
    head = build_training_head(recipe, target_config, vocab)
    if recipe.head.init_lm_head_from_target:
        if features.teacher.rows is None:
            raise TrainingError("head.init_lm_head_from_target needs the target's lm_head rows: "
                                "collect with teacher=last_hidden or use mode=online")
        head.lm_head.weight.data.copy_(features.teacher.rows.float().cpu())

    train_set = features.datasets["train"]
    plan = Plan(len(train_set), cfg.batch_size, cfg.grad_accum, accelerator.num_processes,
                accelerator.process_index, cfg.seed)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * plan.steps_per_epoch))

    model = TTTModel(head, cfg.ttt_steps, cfg.step_weight_decay)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio))
    if accelerator.state.deepspeed_plugin is not None:
        # No dataloader goes through prepare, so DeepSpeed cannot infer its "auto" batch sizes.
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds["train_batch_size"] = plan.global_batch
        ds["gradient_clipping"] = cfg.grad_clip
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    key = inputs_hash(recipe)
    progress = {"step": 0, "tokens": 0, "best_tau_sim": None, "inputs_hash": key,
                "global_batch": plan.global_batch, "num_processes": accelerator.num_processes}
    state_dir = find_state(head_dir) if cfg.resume == "auto" else None
    if state_dir is not None:
        saved = json.loads((state_dir / PROGRESS).read_text())
        if {k: saved.get(k) for k in ("inputs_hash", "global_batch", "num_processes")} == \
                {k: progress[k] for k in ("inputs_hash", "global_batch", "num_processes")}:
            accelerator.load_state(str(state_dir))
            progress = saved
            if main:
                print(f"[train] resuming from {state_dir} at step {progress['step']}", flush=True)
        elif main:
            print(f"[train] {state_dir} belongs to other inputs or another layout; starting over", flush=True)
    metrics_path = head_dir / METRICS
    if main:
        if progress["step"] == 0:
            metrics_path.unlink(missing_ok=True)
        trim_metrics(metrics_path, progress["step"])
    samples_log = head_dir / f"sample_ids.rank{accelerator.process_index}.jsonl"
    if cfg.log_sample_ids and progress["step"] == 0:
        samples_log.unlink(missing_ok=True)
    accelerator.init_trackers(recipe.name, config={"train": recipe.section_hash("train"), "steps": total_steps})

    meta = {"target": recipe.target.name_or_path, "target_hash": target_hash(recipe.target.name_or_path),
            "aux_layer_ids": head.config.aux_layer_ids, "vocab_source": str(recipe.stage_dir("vocab")),
            "vocab_hash": collect.upstream_hash(recipe.stage_dir("vocab"))}
    if main:
        from eyas.data.targets import load_tokenizer

        meta["tokenizer_hash"] = tokenizer_hash(load_tokenizer(recipe.target))

    def checkpoint(name: str, summary: dict) -> None:
        full = full_head(accelerator, model, head.config)
        if main:
            save_head(full, head_dir / name, dict(meta, training=summary))

    step = progress["step"]
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not main)
    window_tokens, window_time = 0, 0.0
    model.train()
    while step < total_steps:
        step_start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        counters = torch.zeros(3 * cfg.ttt_steps + 2, dtype=torch.float64, device=device)
        rows_seen, step_tokens = [], 0
        for rows in plan.micro_batches(step):
            batch, teacher = features(collect.collate([train_set[i] for i in rows]))
            with accelerator.accumulate(model):
                loss, step_counters = model(batch, teacher, embed_weight)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.grad_clip:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad()
            loss_sum += loss.detach() / cfg.grad_accum
            counters += step_counters.detach()
            step_tokens += int(batch["attention_mask"].sum())
            rows_seen += batch["sample_index"].tolist()
        scheduler.step()
        loss_mean = accelerator.reduce(loss_sum, reduction="mean")
        if not torch.isfinite(loss_mean):
            raise TrainingError(
                f"non-finite loss ({loss_mean.item()}) at step {step} (sample rows {rows_seen} on rank "
                f"{accelerator.process_index}); stopped. The last good head is {head_dir / 'last'} and the state "
                f"to resume from is {head_dir / STATE}. Try a lower train.lr or train.mixed_precision=no")
        step += 1
        progress["tokens"] += step_tokens  # this rank's
        window_tokens += step_tokens
        window_time += time.perf_counter() - step_start  # training only: validation and saving excluded
        if cfg.log_sample_ids:
            append_metrics(samples_log, {"step": step, "rows": rows_seen})
        bar.update(1)

        if step % cfg.log_every == 0 or step == total_steps:
            tokens = accelerator.reduce(torch.tensor(window_tokens, device=device), reduction="sum").item()
            stats = summarise(accelerator.reduce(counters, reduction="sum").cpu(), cfg.ttt_steps)
            record = {"step": step, "kind": "train", "loss": loss_mean.item(), "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": tokens / max(window_time, 1e-9), "step_loss": stats["step_loss"],
                      "step_acc": stats["step_acc"]}
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            accelerator.log({"train/loss": record["loss"], "train/lr": record["lr"],
                             "train/tokens_per_s": record["tokens_per_s"]}, step=step)
            if main:
                append_metrics(metrics_path, record)
            window_tokens, window_time = 0, 0.0

        if step % cfg.eval_every == 0 or step == total_steps:
            val = evaluate(accelerator, model, features, embed_weight, cfg)
            if not all(math.isfinite(x) for x in val["step_loss"]):
                raise TrainingError(f"non-finite validation loss {val['step_loss']} at step {step}; stopped. The last "
                                    f"good head is {head_dir / 'last'}. Try a lower train.lr")
            accelerator.log({"val/tau_sim": val["tau_sim"], **{f"val/acc_{k}": a for k, a in enumerate(val["step_acc"])}},
                            step=step)
            summary = {"step": step, "total_steps": total_steps, "val": val, "inputs_hash": key}
            if main:
                append_metrics(metrics_path, {"step": step, "kind": "val", **val})
                bar.write(f"[train] step {step}: tau_sim {val['tau_sim']:.3f}, "
                          f"acc {' '.join(f'{a:.2f}' for a in val['step_acc'])}")
            if progress["best_tau_sim"] is None or val["tau_sim"] > progress["best_tau_sim"]:
                progress["best_tau_sim"] = val["tau_sim"]
                checkpoint("best", summary)
            checkpoint("last", summary)
            if main:
                from eyas.train.plots import plot_training

                plot_training(metrics_path, head_dir / "training.png")
        if step % cfg.save_every == 0 or step == total_steps:
            progress["step"] = step
            save_state(accelerator, head_dir, progress)
    bar.close()

    if main:
        write_done(head_dir, key, stage="train",
                   sections=recipe.section_hash("target", "vocab", "collect", "head", "train"),
                   upstream={s: collect.upstream_hash(recipe.stage_dir(s)) for s in ("data", "vocab", "features")},
                   steps=step, best_tau_sim=progress["best_tau_sim"], num_processes=accelerator.num_processes)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # also ends the process group
    return head_dir / "best"
