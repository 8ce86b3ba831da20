"""Train the EAGLE-3 head with training-time test under accelerate: `state = setup(...)`, then `train(state)`.

    head/best, head/last       native heads (heads/checkpoint.py), written atomically
    head/state/                optimizer, scheduler, RNG (accelerate) + progress.json (data position) for resume
    head/metrics.jsonl         one JSON per log / validation
    head/training.png          validation accuracy per TTT step and tau_sim over training

`eyas train RECIPE` runs one process, `accelerate launch [...] -m eyas train RECIPE` several; the stage
runner (data/stage.py) writes head/DONE.json from what `train` returns.

Data order is a pure function of (seed, epoch): step s of an epoch takes the s-th global batch of a seeded
permutation; rank r's micro-batch m of it is slot m*world + r. So one process with grad_accum=W sees the same
samples per optimizer step as W processes with grad_accum=1, and resume needs only the step number.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from eyas.data.config import CollectConfig
from eyas.data.stage import done_hash, hash_json
from eyas.data.targets import Target, bf16_autocast, pick_device
from eyas.data.vocab import load_vocab
from eyas.heads.checkpoint import save_head
from eyas.heads.config import HeadConfig
from eyas.heads.eagle3 import Eagle3Config, Eagle3Head
from eyas.train.config import TrainConfig
from eyas.train.data import Features, Plan, TrainingError, TrainPaths, validation_batches
from eyas.train.head_init import initial_head
from eyas.train.loss import summarise, ttt_loss
from eyas.train.plots import plot_training
from eyas.train.resume import STATE, append_metrics, resume, resume_key, save_state, trim_metrics

METRICS = "metrics.jsonl"


class TTTModel(nn.Module):
    """The head plus its loss in forward(), so DDP/FSDP/DeepSpeed see one module call per micro-batch."""

    def __init__(self, head: Eagle3Head, ttt_steps: int, step_weight_decay: float, loss: str = "kl",
                 hidden_weight: float = 0.0):
        super().__init__()
        self.head = head
        self.ttt_steps = ttt_steps
        self.step_weight_decay = step_weight_decay
        self.loss = loss
        self.hidden_weight = hidden_weight

    def forward(self, batch: dict, teacher, embed_weight: torch.Tensor):
        batch = dict(batch, aux=batch["aux"].to(self.head.fc.weight.dtype))
        out = ttt_loss(self.head, embed_weight, batch, teacher, self.ttt_steps, self.step_weight_decay, self.loss,
                       self.hidden_weight)
        return out.loss, out.counters()


# ---- the accelerator ----------------------------------------------------------------------------------------

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
    return "bf16" if bf16_autocast("auto", pick_device("auto")) else "no"


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


def configure_deepspeed(accelerator, cfg: TrainConfig, plan: "Plan") -> None:
    """No dataloader goes through prepare, so DeepSpeed cannot infer its "auto" batch sizes: set them."""
    if accelerator.state.deepspeed_plugin is None:
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
    ds["train_batch_size"] = plan.global_batch
    ds["gradient_clipping"] = cfg.grad_clip


# ---- the head and its optimizer -------------------------------------------------------------------------------

def lr_factor(step: int, warmup: int, total: int, min_ratio: float, schedule: str = "cosine") -> float:
    """Linear warmup to 1, then down to min_ratio at `total` along `schedule` (constant: stays at 1)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    falling = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * falling


def make_optimizer(model: nn.Module, cfg: TrainConfig, total_steps: int):
    """AdamW (no weight decay on norms and other 1-d weights) and the warm-up + decay schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio, cfg.lr_schedule))
    return optimizer, scheduler


# ---- set-up ---------------------------------------------------------------------------------------------------------

@dataclass
class TrainState:
    """Everything the loop needs, built by `setup`; `progress` (step, tokens, best tau_sim) is what resumes."""

    cfg: TrainConfig
    paths: TrainPaths
    accelerator: object
    features: Features
    embed_weight: torch.Tensor
    head_config: Eagle3Config
    model: nn.Module  # TTTModel as accelerate prepared it
    optimizer: torch.optim.Optimizer
    scheduler: object
    plan: Plan
    total_steps: int
    progress: dict
    meta: dict  # written into every saved head
    key: str

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def metrics_path(self) -> Path:
        return self.paths.head / METRICS

    @property
    def samples_log(self) -> Path:
        return self.paths.head / f"sample_ids.rank{self.accelerator.process_index}.jsonl"


def setup(cfg: TrainConfig, head_cfg: HeadConfig, collect_cfg: CollectConfig, target: Target, paths: TrainPaths,
          run_name: str = "eyas") -> TrainState:
    """Accelerator, data, head, optimizer, resumed state and logs: ready for `train`."""
    paths.head.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(cfg, paths.head)
    device = accelerator.device
    if accelerator.is_main_process:
        print(f"[train] {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
              f"mixed precision {accelerator.mixed_precision}, device {device}, collect mode {collect_cfg.mode}",
              flush=True)
    if cfg.hidden_loss_weight > 0 and collect_cfg.teacher != "last_hidden":
        raise TrainingError(f"train.hidden_loss_weight={cfg.hidden_loss_weight} needs the target's final hidden "
                            f"states, and collect.teacher={collect_cfg.teacher} stores none: set "
                            "collect.teacher=last_hidden or train.hidden_loss_weight=0")
    vocab = load_vocab(paths.vocab)
    features = Features(collect_cfg, target, paths, vocab, device)
    embed_weight = target.input_embedding().to(device)
    if embed_weight.shape[0] != vocab[1].numel():
        raise TrainingError(f"{paths.vocab}: vocabulary built for {vocab[1].numel()} target tokens, the target's "
                            f"embedding has {embed_weight.shape[0]} rows")
    head = initial_head(head_cfg, target, vocab, cfg.seed, features.teacher)

    plan = Plan(len(features.datasets["train"]), cfg.batch_size, cfg.grad_accum, accelerator.num_processes,
                accelerator.process_index, cfg.seed)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * plan.steps_per_epoch))
    model = TTTModel(head, cfg.ttt_steps, cfg.step_weight_decay, cfg.loss, cfg.hidden_loss_weight)
    optimizer, scheduler = make_optimizer(model, cfg, total_steps)
    configure_deepspeed(accelerator, cfg, plan)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    key = resume_key(cfg, head_cfg, collect_cfg, target, paths)
    progress = {"step": 0, "tokens": 0, "best_tau_sim": None, "inputs_hash": key,
                "global_batch": plan.global_batch, "num_processes": accelerator.num_processes}
    if cfg.resume == "auto":
        progress = resume(accelerator, paths.head, progress)
    meta = head_meta(target, head.config, paths, accelerator.is_main_process)
    state = TrainState(cfg, paths, accelerator, features, embed_weight, head.config, model, optimizer, scheduler,
                       plan, total_steps, progress, meta, key)
    start_logs(state)
    accelerator.init_trackers(run_name, config={"train": hash_json(cfg), "steps": total_steps})
    return state


def head_meta(target: Target, config: Eagle3Config, paths: TrainPaths, main: bool) -> dict:
    """What every saved head records about what it was trained against."""
    meta = {"target": target.name, "target_hash": target.hash, "aux_layer_ids": config.aux_layer_ids,
            "vocab_source": str(paths.vocab), "vocab_hash": done_hash(paths.vocab)}
    if main:  # only rank 0 saves heads: the others need not load the tokenizer
        meta["tokenizer_hash"] = target.tokenizer_hash
    return meta


def start_logs(state: TrainState) -> None:
    """A fresh run starts its logs empty; a resumed one drops what was logged after its saved step."""
    step = state.progress["step"]
    if state.main:
        if step == 0:
            state.metrics_path.unlink(missing_ok=True)
        trim_metrics(state.metrics_path, step)
    if state.cfg.log_sample_ids and step == 0:
        state.samples_log.unlink(missing_ok=True)


# ---- the loop ---------------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    loss: torch.Tensor  # mean over micro-batches and ranks
    counters: torch.Tensor  # this rank's (see loss.TTTResult.counters)
    tokens: int  # this rank's
    rows: list[int]  # the sample rows this rank trained on


def micro_step(state: TrainState, batch: dict, teacher) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one micro-batch; the last of an optimizer step also clips and steps."""
    accelerator, model = state.accelerator, state.model
    with accelerator.accumulate(model):
        loss, counters = model(batch, teacher, state.embed_weight)
        accelerator.backward(loss)
        if accelerator.sync_gradients and state.cfg.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), state.cfg.grad_clip)
        state.optimizer.step()
        state.optimizer.zero_grad()
    return loss.detach(), counters.detach()


def optimizer_step(state: TrainState, step: int) -> StepResult:
    """One optimizer step (0-based `step`): every micro-batch of this rank, then the scheduler."""
    cfg, accelerator = state.cfg, state.accelerator
    loss_sum = torch.zeros((), device=accelerator.device)
    counters = torch.zeros(3 * cfg.ttt_steps + 2, dtype=torch.float64, device=accelerator.device)
    rows_seen, tokens = [], 0
    for rows in state.plan.micro_batches(step):
        batch, teacher = state.features.batch("train", rows)
        loss, step_counters = micro_step(state, batch, teacher)
        loss_sum += loss / cfg.grad_accum
        counters += step_counters
        tokens += int(batch["attention_mask"].sum())
        rows_seen += batch["sample_index"].tolist()
    state.scheduler.step()
    loss_mean = accelerator.reduce(loss_sum, reduction="mean")
    if not torch.isfinite(loss_mean):
        head_dir = state.paths.head
        raise TrainingError(
            f"non-finite loss ({loss_mean.item()}) at step {step} (sample rows {rows_seen} on rank "
            f"{accelerator.process_index}); stopped. The last good head is {head_dir / 'last'} and the state "
            f"to resume from is {head_dir / STATE}. Try a lower train.lr or train.mixed_precision=no")
    return StepResult(loss_mean, counters, tokens, rows_seen)


def log_train(state: TrainState, step: int, result: StepResult, window_tokens: int, window_time: float, bar) -> None:
    accelerator = state.accelerator
    tokens = accelerator.reduce(torch.tensor(window_tokens, device=accelerator.device), reduction="sum").item()
    stats = summarise(accelerator.reduce(result.counters, reduction="sum").cpu(), state.cfg.ttt_steps)
    record = {"step": step, "kind": "train", "loss": result.loss.item(), "lr": state.scheduler.get_last_lr()[0],
              "tokens_per_s": tokens / max(window_time, 1e-9), "step_loss": stats["step_loss"],
              "step_acc": stats["step_acc"]}
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
    accelerator.log({"train/loss": record["loss"], "train/lr": record["lr"],
                     "train/tokens_per_s": record["tokens_per_s"]}, step=step)
    if state.main:
        append_metrics(state.metrics_path, record)


@torch.no_grad()
def evaluate(state: TrainState) -> dict:
    """Pooled validation loss, accuracy per TTT step and tau_sim over every rank's batches."""
    cfg, accelerator = state.cfg, state.accelerator
    n = len(state.features.datasets["validation"])
    batches = validation_batches(n, cfg.batch_size, accelerator.num_processes, accelerator.process_index,
                                 cfg.eval_max_batches)
    if not batches:
        raise TrainingError(f"the validation split has {n} samples, fewer than one batch per process "
                            f"({cfg.batch_size} x {accelerator.num_processes})")
    state.model.eval()
    total = torch.zeros(3 * cfg.ttt_steps + 2, dtype=torch.float64, device=accelerator.device)
    for rows in batches:
        batch, teacher = state.features.batch("validation", rows)
        _, counters = state.model(batch, teacher, state.embed_weight)
        total += counters.to(total.device)
    state.model.train()
    return summarise(accelerator.reduce(total, reduction="sum").cpu(), cfg.ttt_steps)


def checkpoint(state: TrainState, name: str, summary: dict) -> None:
    """head/<name>: a CPU fp32 copy of the head (gathering sharded weights takes every rank), saved by rank 0."""
    weights = state.accelerator.get_state_dict(state.model)
    if not state.main:
        return
    head = Eagle3Head(state.head_config)
    head.load_state_dict({k.removeprefix("head."): v.float().cpu() for k, v in weights.items()}, strict=True)
    save_head(head, state.paths.head / name, dict(state.meta, training=summary))


def validate(state: TrainState, step: int, bar) -> None:
    """Evaluate, log, keep head/best (highest tau_sim) and head/last, redraw training.png."""
    val = evaluate(state)
    head_dir = state.paths.head
    if not all(math.isfinite(x) for x in val["step_loss"]):
        raise TrainingError(f"non-finite validation loss {val['step_loss']} at step {step}; stopped. The last "
                            f"good head is {head_dir / 'last'}. Try a lower train.lr")
    state.accelerator.log({"val/tau_sim": val["tau_sim"],
                           **{f"val/acc_{k}": a for k, a in enumerate(val["step_acc"])}}, step=step)
    summary = {"step": step, "total_steps": state.total_steps, "val": val, "inputs_hash": state.key}
    if state.main:
        append_metrics(state.metrics_path, {"step": step, "kind": "val", **val})
        bar.write(f"[train] step {step}: tau_sim {val['tau_sim']:.3f}, "
                  f"acc {' '.join(f'{a:.2f}' for a in val['step_acc'])}")
    best = state.progress["best_tau_sim"]
    if best is None or val["tau_sim"] > best:
        state.progress["best_tau_sim"] = val["tau_sim"]
        checkpoint(state, "best", summary)
    checkpoint(state, "last", summary)
    if state.main:
        plot_training(state.metrics_path, head_dir / "training.png")


def train(state: TrainState) -> dict:
    """Run the optimizer steps left; returns the figures DONE records."""
    cfg, accelerator, progress = state.cfg, state.accelerator, state.progress
    step = progress["step"]
    bar = tqdm(total=state.total_steps, initial=step, desc="train", unit="step", disable=not state.main)
    window_tokens, window_time = 0, 0.0
    state.model.train()
    while step < state.total_steps:
        start = time.perf_counter()
        result = optimizer_step(state, step)
        step += 1
        progress["tokens"] += result.tokens  # this rank's
        window_tokens += result.tokens
        window_time += time.perf_counter() - start  # training only: validation and saving excluded
        if cfg.log_sample_ids:
            append_metrics(state.samples_log, {"step": step, "rows": result.rows})
        bar.update(1)
        last = step == state.total_steps
        if step % cfg.log_every == 0 or last:
            log_train(state, step, result, window_tokens, window_time, bar)
            window_tokens, window_time = 0, 0.0
        if step % cfg.eval_every == 0 or last:
            validate(state, step, bar)
        if step % cfg.save_every == 0 or last:
            progress["step"] = step
            save_state(accelerator, state.paths.head, progress)
    bar.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # also ends the process group
    return {"steps": step, "best_tau_sim": progress["best_tau_sim"], "num_processes": accelerator.num_processes}
