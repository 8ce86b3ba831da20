"""Settings of the train section of a recipe."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    ttt_steps: int = 7
    step_weight_decay: float = 0.8
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    # fp32 | bf16 | fp16 (fp16 only on CUDA); "auto" picks bf16 where supported (CUDA with bf16, and CPUs).
    mixed_precision: str = "auto"
    eval_every: int = 200
    save_every: int = 200
    eval_max_batches: int | None = 50
    log_every: int = 10
    # wandb | tensorboard | trackio | none
    trackers: list[str] = field(default_factory=list)
    seed: int = 0
    num_workers: int = 0
    # Keep head/state/ (optimizer, scheduler, RNG, data position) for resume; "auto" resumes when it matches.
    resume: str = "auto"  # auto | never
    # Write head/sample_ids.rank<R>.jsonl: the sample rows each rank trained on at each step (checks sharding).
    log_sample_ids: bool = False
