"""Per-GPU memory estimate of a training run, for sizing recipes before renting machines (tests/test_recipes_gpu.py).

Mixed-precision Adam keeps, per trainable parameter: bf16 weights (2 B), bf16 gradients (2 B) and fp32
master weights + two moments (12 B). ZeRO-2 shards gradients and optimizer states over the data-parallel
ranks, ZeRO-3 (and FSDP full-shard) the weights too. The frozen target (online mode) is replicated in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryEstimate:
    head_params: int
    target_params: int
    num_gpus: int
    zero_stage: int
    head_states_gb: float
    target_gb: float
    activations_gb: float

    @property
    def total_gb(self) -> float:
        return self.head_states_gb + self.target_gb + self.activations_gb


def estimate_memory(head_params: int, target_params: int, num_gpus: int, zero_stage: int, online: bool,
                    tokens_per_gpu: int, hidden_size: int, draft_vocab_size: int, ttt_steps: int,
                    target_hidden_size: int | None = None, target_sharded: bool = False) -> MemoryEstimate:
    gb = 1024 ** 3
    weights, grads, optim = 2 * head_params, 2 * head_params, 12 * head_params
    if zero_stage >= 3:
        states = (weights + grads + optim) / num_gpus
    elif zero_stage == 2:
        states = weights + (grads + optim) / num_gpus
    elif zero_stage == 1:
        states = weights + grads + optim / num_gpus
    else:
        states = weights + grads + optim
    target = 2 * target_params if online else 0
    if online and target_sharded:
        target /= num_gpus
    # Activations kept for backward, per token and TTT step: the 2H layer input, q/k/v/o, the MLP
    # (about 4H for SwiGLU inputs at intermediate ~3.5H), fp32 draft logits and their softmax; plus the
    # three target features and the teacher's draft-vocab logits once.
    th = target_hidden_size or hidden_size
    per_step = 2 * (2 * hidden_size + 4 * hidden_size + 8 * hidden_size) + 2 * 4 * draft_vocab_size
    per_token = ttt_steps * per_step + 2 * 3 * th + 4 * draft_vocab_size
    activations = tokens_per_gpu * per_token
    return MemoryEstimate(head_params, target_params, num_gpus, zero_stage,
                          states / gb, target / gb, activations / gb)
