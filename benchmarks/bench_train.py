"""Training throughput of the TTT loop on the real SmolLM2-135M target: tokens/s and model FLOP utilisation.

    python benchmarks/bench_train.py [--out /tmp/eyas-bench-train] [--steps 12] [--records 96]

Runs the real stages once (prepare a ShareGPT slice, build the draft vocab, collect features), then times
optimizer steps (data loading + teacher + TTT forward/backward + AdamW) of the trainer as `setup` builds it, in
offline mode (features from disk) and online mode (target in the loop). FLOPs are counted exactly on the timed
batches with torch.utils.flop_counter (matmuls of forward and backward); utilisation is against this machine's
fp32 and bf16 matmul throughput measured in the same run. Prints a Markdown table and writes bench_train.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode


def matmul_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """Best-of matmul throughput for square n x n products in `dtype` (GFLOP/s)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def bench_recipe(out: Path, records: int, steps: int, mode: str, batch_size: int):
    from eyas.recipe import load_recipe

    return load_recipe(None, [
        f"output_dir={out}", "data.max_length=512", f"data.corpora=[{{kind: sharegpt, max_records: {records}}}]",
        "vocab.draft_vocab_size=4096", "vocab.coverage_target=null", f"collect.mode={mode}",
        "collect.batch_size=8", f"train.batch_size={batch_size}", f"train.max_steps={steps}", "train.ttt_steps=7",
        "train.resume=never",
    ])


def prepare_stages(recipe) -> None:
    from eyas.stages import run_one

    for stage in ("prepare", "vocab", "collect"):
        run_one(stage, recipe)


def time_mode(recipe, steps: int, warmup: int = 1) -> dict:
    from eyas.data.targets import Target
    from eyas.train.loop import TrainPaths, micro_step, setup

    # The trainer's own set-up (accelerator, features, head, optimizer); its head folder is the benchmark's.
    paths = TrainPaths(data=recipe.stage_dir("data"), vocab=recipe.stage_dir("vocab"),
                       features=recipe.stage_dir("features"), head=recipe.stage_dir(f"bench-head-{recipe.collect.mode}"))
    state = setup(recipe.train, recipe.head, recipe.collect, Target.resolve(recipe.target), paths,
                  run_name="bench_train")

    def load(step: int):
        return state.features.batch("train", state.plan.micro_batches(step)[0])

    def train_step(batch, teacher) -> None:
        micro_step(state, batch, teacher)
        state.scheduler.step()

    for s in range(warmup):
        train_step(*load(s))
    tokens = head_flops = feature_flops = 0
    t_load = t_train = 0.0
    for s in range(warmup, warmup + steps):
        # Counted and timed in one pass (the machine is too busy for two): the counter's dispatch overhead
        # is inside the timings, so the utilisation figures are slightly conservative.
        t = time.perf_counter()
        with FlopCounterMode(display=False) as counter:
            batch, teacher = load(s)
        t_load += time.perf_counter() - t
        feature_flops += counter.get_total_flops()
        t = time.perf_counter()
        with FlopCounterMode(display=False) as counter:
            train_step(batch, teacher)
        t_train += time.perf_counter() - t
        head_flops += counter.get_total_flops()
        tokens += int(batch["attention_mask"].sum())
    elapsed = t_load + t_train
    return {"tokens": tokens, "seconds": elapsed, "seconds_features": t_load, "tokens_per_s": tokens / elapsed,
            "head_flops_per_token": head_flops / tokens, "feature_flops_per_token": feature_flops / tokens,
            "gflops": (head_flops + feature_flops) / elapsed / 1e9, "head_gflops_in_train_step": head_flops / t_train / 1e9,
            "draft_vocab_size": state.head_config.draft_vocab_size, "batch_size": recipe.train.batch_size,
            "steps": steps, "autocast_bf16": state.accelerator.mixed_precision == "bf16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/eyas-bench-train")
    parser.add_argument("--records", type=int, default=96)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out)

    offline = bench_recipe(out, args.records, args.steps, "offline", args.batch_size)
    prepare_stages(offline)
    peak = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}
    results = {"threads": torch.get_num_threads(), "matmul_gflops": peak, "modes": {}}
    for mode in ("offline", "online"):
        recipe = offline if mode == "offline" else bench_recipe(out, args.records, args.steps, "online", args.batch_size)
        r = time_mode(recipe, args.steps)
        r["util_vs_fp32"] = r["gflops"] / peak["fp32"]
        r["util_vs_bf16"] = r["gflops"] / peak["bf16"]
        results["modes"][mode] = r
        print(mode, json.dumps(r), flush=True)
    peak_after = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}
    results["matmul_gflops_after"] = peak_after

    print(f"threads {results['threads']}; matmul GFLOP/s fp32 {peak['fp32']:.1f} / bf16 {peak['bf16']:.1f} "
          f"(after: {peak_after['fp32']:.1f} / {peak_after['bf16']:.1f})")
    print("| mode | tokens/s | head MFLOP/token (fwd+bwd) | target MFLOP/token | GFLOP/s (all counted) "
          "| vs fp32 matmul | vs bf16 matmul | head GFLOP/s in its train step |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results["modes"].items():
        print(f"| {mode} | {r['tokens_per_s']:.0f} | {r['head_flops_per_token'] / 1e6:.1f} | "
              f"{r['feature_flops_per_token'] / 1e6:.1f} | {r['gflops']:.1f} | {100 * r['util_vs_fp32']:.0f}% | "
              f"{100 * r['util_vs_bf16']:.0f}% | {r['head_gflops_in_train_step']:.1f} |")
    (out / "bench_train.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
