"""Settings of the train section of a recipe (choices are Literals, ranges field metadata: checked at load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class TrainConfig:
    ttt_steps: int = field(default=7, metadata={"min": 1})
    # Loss weight of TTT step k is this ** k.
    step_weight_decay: float = field(default=0.8, metadata={"gt": 0, "max": 1})
    # What each position is trained towards (train/loss.py draft_loss): kl (the teacher's distribution),
    # hard (its argmax), lk (the acceptance probability, -log sum min(p, q)) or kl+lk.
    loss: Literal["kl", "hard", "lk", "kl+lk"] = "kl"
    # Weight of a second term at every trained position: the head's normed output against the target's final
    # normed hidden state (train/loss.py hidden_regression; needs collect.teacher=last_hidden). 0 = off.
    hidden_loss_weight: float = field(default=0.0, metadata={"min": 0})
    epochs: float = field(default=1.0, metadata={"gt": 0})
    max_steps: int | None = field(default=None, metadata={"min": 1})
    batch_size: int = field(default=1, metadata={"min": 1})
    grad_accum: int = field(default=1, metadata={"min": 1})
    lr: float = field(default=1e-4, metadata={"gt": 0})
    weight_decay: float = field(default=0.0, metadata={"min": 0})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata={"min": 0, "lt": 1, "len": 2})
    warmup_steps: int = field(default=50, metadata={"min": 0})
    # After warm-up the learning rate falls to lr * min_lr_ratio at the last step: along a cosine, a straight
    # line, or not at all (constant).
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = field(default=0.1, metadata={"min": 0, "max": 1})
    grad_clip: float = field(default=0.5, metadata={"min": 0})  # 0 disables clipping
    # "auto" picks bf16 where supported (CUDA with bf16, and CPUs); fp16 only on CUDA; "no" is fp32
    # (accelerate's word: YAML's unquoted `no` is read as false and taken as "no").
    mixed_precision: Literal["auto", "fp32", "no", "bf16", "fp16"] = "auto"
    eval_every: int = field(default=200, metadata={"min": 1})
    save_every: int = field(default=200, metadata={"min": 1})
    eval_max_batches: int | None = field(default=50, metadata={"min": 1})
    log_every: int = field(default=10, metadata={"min": 1})
    trackers: list[Literal["wandb", "tensorboard", "trackio", "none"]] = field(default_factory=list)
    seed: int = 0
    # Keep head/state/ (optimizer, scheduler, RNG, data position) for resume; "auto" resumes when it matches.
    resume: Literal["auto", "never"] = "auto"
    # Write head/sample_ids.rank<R>.jsonl: the sample rows each rank trained on at each step (checks sharding).
    log_sample_ids: bool = False

    removed_keys = {"num_workers": "it was never read"}
