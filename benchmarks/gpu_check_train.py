"""GPU check, section 2: head training throughput at a Llama-3.1-8B head's shape.

One optimizer step is what the training loop runs per micro-batch: the TTT loss (eyas.train.loss.ttt_loss,
teacher logits from the target's lm_head rows over the draft vocabulary) under bf16 autocast with fp32
master weights, backward, gradient clipping at 0.5, AdamW. Offline: synthetic aux features, teacher hidden
states and token ids (random, 95% of positions with the target's next token in the draft vocabulary).
Online: a random Llama-3.1-8B-shaped target in bf16 computes them in the loop (OnlineFeatures).

FLOPs, two ways:
  counted  torch.utils.flop_counter on one untimed step: every matmul of forward and backward as executed
           (attention's full T x T square although half is masked; the online target forward included);
  model    analytic, what the step must compute: 2*m*n*k per matmul, backward twice the forward for the
           trained layers and once for fc (its input needs no gradient), causal attention counted half,
           lm_head only at trained positions, the teacher's lm_head rows once, the target forward once.
           The same formula with attention's full square must match the counter within 3% offline (a check;
           online the counter may miss the target's fused attention kernel, so the ratio is only reported).
MFU = model FLOPs / step time / the H200's dense bf16 peak (989.4 TFLOP/s); the measured bf16 matmul rate of
the same GPU is reported beside it as the practical ceiling.
"""

from __future__ import annotations

import time

import torch

from gpu_check_common import (H200_BF16_PEAK_TFLOPS, Ctx, Shape, draft_vocab, find, llama_config, matmul_tflops,
                              new_head, peak_memory_gib, reset_peak_memory, sync)


def head_model_flops(s: Shape, valid: list[int], teacher_rows: int, causal: bool = True) -> float:
    """Analytic FLOPs of one TTT step (forward + backward) for one batch; see the module docstring.
    causal=False counts attention's full square, as executed (then it must match the counter)."""
    n, hd = s.batch * s.seq, s.hidden // s.heads
    layer = 2 * n * (2 * s.hidden * (s.heads + 2 * s.kv_heads) * hd  # q, k, v from [embed | hidden]
                     + s.heads * hd * s.hidden  # o_proj
                     + 3 * s.hidden * s.intermediate)  # gate, up, down
    attention = (2 if causal else 4) * s.batch * s.heads * hd * s.seq * s.seq  # QK^T and PV
    lm_head = sum(2 * v * s.hidden * s.draft_vocab for v in valid)
    fc = 2 * n * 3 * s.hidden * s.hidden
    return 3 * (s.ttt_steps * (layer + attention) + lm_head) + 2 * fc + 2 * teacher_rows * s.hidden * s.draft_vocab


def target_model_flops(s: Shape, causal: bool = True) -> float:
    """Analytic FLOPs of the target's forward over the batch (no backward: the target is frozen)."""
    n, hd = s.batch * s.seq, s.hidden // s.heads
    per_layer = 2 * n * (s.hidden * (s.heads + 2 * s.kv_heads) * hd + s.heads * hd * s.hidden
                         + 3 * s.hidden * s.intermediate) + (2 if causal else 4) * s.batch * s.heads * hd * s.seq ** 2
    return s.layers * per_layer + 2 * n * s.hidden * s.vocab  # + the full-vocabulary logits (target_in_draft)


def synthetic_batch(s: Shape, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, s.vocab, (s.batch, s.seq), device=device, generator=g)
    return {"input_ids": ids,
            "loss_mask": torch.ones(s.batch, s.seq, dtype=torch.long, device=device),
            "attention_mask": torch.ones(s.batch, s.seq, dtype=torch.bool, device=device),
            "aux": torch.randn(s.batch, s.seq, 3 * s.hidden, device=device, generator=g).to(torch.bfloat16),
            "teacher_hidden": torch.randn(s.batch, s.seq, s.hidden, device=device, generator=g).to(torch.bfloat16),
            "target_in_draft": torch.rand(s.batch, s.seq, device=device, generator=g) < 0.95}


def teacher_positions(batch: dict, ttt_steps: int) -> int:
    """Positions whose teacher logits some TTT step reads (the union ttt_loss computes once)."""
    from eyas.train.loss import shift_right, step_valid

    needed = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    for k in range(ttt_steps):
        needed |= shift_right(step_valid(batch, k), k + 1)
    return int(needed.sum())


class Trainer:
    """The head, its optimizer and one training step, offline (synthetic features) or online (target)."""

    def __init__(self, ctx: Ctx, online: bool):
        s, dev = ctx.shape, ctx.device
        self.ctx, self.shape, self.online = ctx, s, online
        Teacher = find("eyas.data.features:Teacher", "eyas.data.collect:Teacher")
        self.d2t, self.t2d = draft_vocab(s.vocab, s.draft_vocab)
        if online:
            from eyas.data.config import CollectConfig

            target = ctx.big_target()
            OnlineFeatures = find("eyas.data.features:OnlineFeatures", "eyas.data.collect:OnlineFeatures")
            self.features = OnlineFeatures(target, (self.d2t, self.t2d), CollectConfig(), s.aux_layer_ids)
            self.teacher = self.features.teacher()
            self.embed_weight = target.get_input_embeddings().weight
            config = target.config
        else:
            config = llama_config(s)
            g = torch.Generator(device=dev).manual_seed(1)
            self.embed_weight = (0.02 * torch.randn(s.vocab, s.hidden, device=dev, generator=g)).to(ctx.dtype)
            rows = (0.02 * torch.randn(s.draft_vocab, s.hidden, device=dev, generator=g)).to(ctx.dtype)
            self.teacher = Teacher(rows, None, s.draft_vocab)
        self.head = new_head(config, s.aux_layer_ids, draft_size=s.draft_vocab, device=dev).train().requires_grad_(True)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=1e-4, betas=(0.9, 0.95))
        self.raw = synthetic_batch(s, dev)
        if online:
            self.raw = {k: self.raw[k] for k in ("input_ids", "loss_mask", "attention_mask")}

    def step(self):
        from eyas.train.loss import BatchTeacher, ttt_loss

        batch = self.features(self.raw) if self.online else self.raw
        teacher = BatchTeacher(self.teacher, batch)
        batch = dict(batch, aux=batch["aux"].to(self.head.fc.weight.dtype))  # as the training loop's TTTModel
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.ctx.cuda):
            out = ttt_loss(self.head, self.embed_weight, batch, teacher, self.shape.ttt_steps, 0.8)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out, batch


def measure(ctx: Ctx, online: bool, steps: int, warmup: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    s = ctx.shape
    trainer = Trainer(ctx, online)
    for _ in range(warmup):
        out, batch = trainer.step()
    with FlopCounterMode(display=False) as counter:
        out, batch = trainer.step()
    counted = counter.get_total_flops()
    valid = [int(c) for c in out.step_count]
    teacher_rows = teacher_positions(batch, s.ttt_steps)
    model = head_model_flops(s, valid, teacher_rows)
    executed = head_model_flops(s, valid, teacher_rows, causal=False)
    if online:
        model += target_model_flops(s)
        executed += target_model_flops(s, causal=False)
    reset_peak_memory(ctx.device)
    sync(ctx.device)
    start = time.perf_counter()
    for _ in range(steps):
        out, _ = trainer.step()
    sync(ctx.device)
    step_s = (time.perf_counter() - start) / steps
    loss = float(out.loss.detach())
    row = {"steps_timed": steps, "step_ms": 1e3 * step_s, "tokens_per_s": s.batch * s.seq / step_s,
           "trained_positions_per_ttt_step": valid, "model_tflop_per_step": model / 1e12,
           "counted_tflop_per_step": counted / 1e12, "counted_over_analytic_executed": counted / executed,
           "model_tflops": model / step_s / 1e12,
           "counted_tflops": counted / step_s / 1e12, "peak_memory_gib": peak_memory_gib(ctx.device),
           "loss": loss, "loss_finite": bool(torch.isfinite(out.loss.detach()))}
    if ctx.cuda:
        row["mfu"] = row["model_tflops"] / H200_BF16_PEAK_TFLOPS
        row["counted_flops_utilisation"] = row["counted_tflops"] / H200_BF16_PEAK_TFLOPS
    del trainer
    return row


def run(ctx: Ctx) -> dict:
    s = ctx.shape
    results = {"shape": {"hidden": s.hidden, "intermediate": s.intermediate, "heads": s.heads, "kv_heads": s.kv_heads,
                         "target_vocab": s.vocab, "draft_vocab": s.draft_vocab, "ttt_steps": s.ttt_steps,
                         "seq": s.seq, "batch": s.batch},
               "precision": "bf16 autocast, fp32 master weights" if ctx.cuda else "fp32 (CPU)",
               "peak_tflops_spec": H200_BF16_PEAK_TFLOPS if ctx.cuda else None,
               "matmul_tflops_measured": matmul_tflops(ctx.device, ctx.dtype, 8192 if ctx.cuda else 256)}
    failures = []
    steps, warmup = (1, 1) if ctx.cpu else (6, 2)
    for name, online in (("offline", False), ("online", True)):
        row = measure(ctx, online, steps, warmup)
        results[name] = row
        if not row["loss_finite"]:
            failures.append(f"{name}: non-finite loss {row['loss']}")
        # The analytic count, with attention's full square, must agree with torch's counter: else the
        # MFU's numerator is wrong (or the training step computes something this file does not know of).
        # Offline only: the counter misses the target's fused attention kernel on some devices (the CPU's).
        if not online and abs(row["counted_over_analytic_executed"] - 1) > 0.03:
            failures.append(f"{name}: counted FLOPs are {row['counted_over_analytic_executed']:.3f}x the analytic "
                            "count of the executed matmuls")
        if ctx.cuda:
            torch.cuda.empty_cache()
    results["failures"] = failures
    return results


def markdown(results: dict) -> list[str]:
    shape = results.get("shape", {})
    lines = [f"Head shape: {shape}; {results.get('precision')}. Measured matmul rate "
             f"{results.get('matmul_tflops_measured', 0):.4g} TFLOP/s (spec peak {results.get('peak_tflops_spec')}).", "",
             "| mode | step ms | tokens/s | model TFLOP/step | counted TFLOP/step | model TFLOP/s | MFU | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("offline", "online"):
        r = results.get(name)
        if not r:
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        lines.append(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['model_tflop_per_step']:.4g} | "
                     f"{r['counted_tflop_per_step']:.4g} | {r['model_tflops']:.4g} | {mfu} | {mem} |")
    return lines
