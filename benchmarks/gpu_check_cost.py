"""GPU check, section 3: the GPU cost model of speculative decoding, measured on the Llama-3.1-8B-shaped target.

  verify forward   the target (bf16) through the decoders' own runner (TargetRunner: KV cache, 4D mask) for
                   1..64 new tokens on a cache prefilled to 512 and 4096 tokens; the cache is cut back after
                   each call, so every call sees the same context;
  draft step       one head forward of 1, topk and 8 rows over a head cache of the same context, plus the
                   draft logits and their top-k: what each tree level (chain position) costs;
  decoder steps    SpeculativeDecoder on a 512-token prompt for each of autotune's shapes (a random head,
                   so drafts are rarely accepted): its GenerationStats split per verify step into target,
                   draft and the rest (the decoder's own overhead: acceptance, cache gathers, bookkeeping).

Each shape's step time is then predicted from the first two (verify forward at 1 + drafted tokens, one
draft step per level) and compared with the measured step; and from the costs, the tokens per step a shape
needs to break even with plain decoding, and its predicted speedup for given acceptance lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gpu_check_common import Ctx, StubTokenizer, find, new_head, time_calls

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)
ACCEPTANCE_LENGTHS = (2.0, 3.0, 4.0)  # tokens per verify step (tau) at which speedups are predicted


def contexts(ctx: Ctx) -> tuple[int, ...]:
    return (64, 256) if ctx.cpu else (512, 4096)


def forward_times(ctx: Ctx, target, context: int, reps: int) -> dict[int, float]:
    """Median ms of a verify forward of q new tokens (causal among them) after `context` cached tokens."""
    TargetRunner = find("eyas.eval.target_runner:TargetRunner", "eyas.eval.decoder:TargetRunner")
    runner = TargetRunner(target)
    vocab = target.config.vocab_size
    g = torch.Generator(device=ctx.device).manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), device=ctx.device, generator=g)
    runner.forward(prefix, torch.arange(context, device=ctx.device)[None], last_only=True)
    empty = torch.empty(0, dtype=torch.long, device=ctx.device)
    out = {}
    for q in TOKEN_COUNTS:
        ids = torch.randint(0, vocab, (1, q), device=ctx.device, generator=g)
        positions = torch.arange(context, context + q, device=ctx.device)[None]

        def call():
            runner.forward(ids, positions)
            runner.keep(context, empty)  # back to `context` cached entries

        out[q] = time_calls(call, ctx.device, reps)["median_ms"]
    return out


def draft_step_times(ctx: Ctx, head, context: int, rows_list: tuple[int, ...], topk: int, reps: int) -> dict[int, float]:
    """Median ms of one head forward of `rows` new rows over a head cache of `context` positions."""
    c = head.config
    dev, dtype = ctx.device, next(head.parameters()).dtype
    g = torch.Generator(device=dev).manual_seed(1)
    prefix_k = torch.randn(1, c.num_key_value_heads, context, c.head_dim, device=dev, generator=g).to(dtype)
    prefix_v = torch.randn(1, c.num_key_value_heads, context, c.head_dim, device=dev, generator=g).to(dtype)
    out = {}
    for rows in rows_list:
        hidden = torch.randn(1, rows, c.hidden_size, device=dev, generator=g).to(dtype)
        embeds = torch.randn(1, rows, c.hidden_size, device=dev, generator=g).to(dtype)
        positions = torch.arange(context, context + rows, device=dev)[None]
        visible = torch.ones(1, 1, rows, context + rows, dtype=torch.bool, device=dev)

        @torch.no_grad()
        def call():
            q, k, v, residual = head.qkv(hidden, embeds, positions)
            h = head.finish(head.attend(q, torch.cat([prefix_k, k], 2), torch.cat([prefix_v, v], 2), visible), residual)
            head.logits(h).float().log_softmax(-1).topk(topk, dim=-1)

        out[rows] = time_calls(call, dev, reps)["median_ms"]
    return out


def interpolate(times: dict[int, float], q: int) -> float:
    xs = sorted(times)
    return float(np.interp(q, xs, [times[x] for x in xs]))


def shape_plan(shape: dict) -> tuple[int, int, int]:
    """(tokens verified per step besides the root, head forwards per step, rows of the later forwards)."""
    if shape["mode"] == "chain":
        return shape["num_speculative_tokens"], shape["num_speculative_tokens"], 1
    return shape["budget"], shape["depth"], shape["topk"]


def decoder_steps(ctx: Ctx, target, head, shape: dict, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Per verify step of a real SpeculativeDecoder run: target, draft and the decoder's own time (ms)."""
    from eyas.eval.config import DecoderConfig
    from eyas.eval.decoder import SpeculativeDecoder

    cfg = DecoderConfig(max_new_tokens=new_tokens, **shape)
    warm = SpeculativeDecoder(target, head, StubTokenizer(), dataclasses.replace(cfg, max_new_tokens=8))
    warm.generate(prompt[:, :64])  # kernels, allocator
    stats = SpeculativeDecoder(target, head, StubTokenizer(), cfg).generate(prompt)
    steps = max(stats.target_forwards - 1, 1)  # the prefill makes the first token on its own
    return {"steps": steps, "tokens": len(stats.tokens), "tau": (len(stats.tokens) - 1) / steps,
            "target_ms": 1e3 * max(stats.time_target_s - stats.ttft_s, 0.0) / steps,  # prefill taken out
            "draft_ms": 1e3 * stats.time_draft_s / steps, "other_ms": 1e3 * stats.time_other_s / steps,
            "step_ms": 1e3 * max(stats.total_s - stats.ttft_s, 0.0) / steps}


def run(ctx: Ctx) -> dict:
    target = ctx.big_target()
    s = ctx.shape
    default_shapes = find("eyas.eval.autotune:default_shapes", "eyas.eval.decoder:default_shapes")
    shapes = list(default_shapes(ctx.device))
    reps = 3 if ctx.cpu else 10
    results = {"dtype": str(ctx.dtype).removeprefix("torch."), "forward_ms": {}, "draft_step_ms": {}}
    for context in contexts(ctx):
        results["forward_ms"][context] = forward_times(ctx, target, context, reps)
    head = new_head(target.config, s.aux_layer_ids, draft_size=s.draft_vocab, device=ctx.device, dtype=ctx.dtype).eval()
    widths = sorted({1, 8} | {shape_plan(x)[2] for x in shapes})
    topk = max(x.get("topk", 1) for x in shapes)
    for context in contexts(ctx):
        results["draft_step_ms"][context] = draft_step_times(ctx, head, context, tuple(widths), topk, reps)

    context = contexts(ctx)[0]
    prompt = torch.randint(0, s.vocab, (1, context), generator=torch.Generator().manual_seed(3)).to(ctx.device)
    forward, draft = results["forward_ms"][context], results["draft_step_ms"][context]
    plain_ms = forward[1]
    rows = []
    for shape in shapes:
        verified, levels, width = shape_plan(shape)
        measured = decoder_steps(ctx, target, head, shape, prompt, 12 if ctx.cpu else 48)
        predicted_target = interpolate(forward, 1 + verified)
        predicted_draft = draft[1] + (levels - 1) * interpolate(draft, width)
        predicted = predicted_target + predicted_draft + measured["other_ms"]
        row = {"shape": shape, "verified_tokens": 1 + verified, "head_forwards": levels, "measured": measured,
               "predicted_target_ms": predicted_target, "predicted_draft_ms": predicted_draft,
               "predicted_step_ms": predicted, "measured_over_predicted": measured["step_ms"] / predicted,
               "break_even_tau": predicted / plain_ms}
        row["predicted_speedup"] = {str(tau): min(tau, levels + 1) / (predicted / plain_ms) for tau in ACCEPTANCE_LENGTHS}
        rows.append(row)
    results["context_for_shapes"] = context
    results["plain_step_ms"] = plain_ms
    results["shapes"] = rows
    results["verify_cost_vs_plain"] = {c: {q: t / f[1] for q, t in f.items()} for c, f in results["forward_ms"].items()}
    best = {str(tau): max(rows, key=lambda r: r["predicted_speedup"][str(tau)])["shape"] for tau in ACCEPTANCE_LENGTHS}
    results["best_shape_by_tau"] = best
    results["failures"] = []
    del head
    return results


def markdown(results: dict) -> list[str]:
    lines = [f"Target forward ms ({results.get('dtype')}) by new tokens (columns) and cached context (rows):", "",
             "| context | " + " | ".join(str(q) for q in TOKEN_COUNTS) + " |",
             "|---|" + "---|" * len(TOKEN_COUNTS)]
    for context, times in results.get("forward_ms", {}).items():
        lines.append(f"| {context} | " + " | ".join(f"{times[q]:.2f}" for q in TOKEN_COUNTS) + " |")
    lines += ["", "Head draft step ms by rows (one forward + logits + top-k):", ""]
    for context, times in results.get("draft_step_ms", {}).items():
        lines.append(f"- context {context}: " + ", ".join(f"{r} rows {t:.2f}" for r, t in times.items()))
    lines += ["", f"Autotune's shapes at context {results.get('context_for_shapes')} (plain step "
              f"{results.get('plain_step_ms', 0):.2f} ms); measured per verify step vs predicted from the costs above:", "",
              "| shape | verified | target ms | draft ms | other ms | step ms | predicted | meas/pred | break-even tau | "
              + " | ".join(f"speedup @tau {t:g}" for t in ACCEPTANCE_LENGTHS) + " |",
              "|---|---|---|---|---|---|---|---|---|" + "---|" * len(ACCEPTANCE_LENGTHS)]
    for r in results.get("shapes", []):
        m = r["measured"]
        shape = ",".join(f"{k}={v}" for k, v in r["shape"].items() if k != "mode")
        lines.append(f"| {r['shape']['mode']} {shape} | {r['verified_tokens']} | {m['target_ms']:.2f} | "
                     f"{m['draft_ms']:.2f} | {m['other_ms']:.2f} | {m['step_ms']:.2f} | {r['predicted_step_ms']:.2f} | "
                     f"{r['measured_over_predicted']:.2f} | {r['break_even_tau']:.2f} | "
                     + " | ".join(f"{r['predicted_speedup'][str(t)]:.2f}" for t in ACCEPTANCE_LENGTHS) + " |")
    lines += ["", f"Best predicted shape by tau: {results.get('best_shape_by_tau')}"]
    return lines
