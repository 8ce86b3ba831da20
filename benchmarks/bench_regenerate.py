"""Regeneration side by side: HF generate against the serving engine (vLLM) on the same prompts.

    python benchmarks/bench_regenerate.py                      # the quickstart's prompts and settings
    python benchmarks/bench_regenerate.py --prompts 64 --engines transformers,vllm-float32

Each engine answers the same prompts (the quickstart recipe's data section: short ShareGPT first turns,
greedy, regenerate_max_new_tokens) into its own resume log, from a cold start: the transformers row
includes loading the target and tuning its matmul layout, the vLLM rows starting the server. Figures:
answer tokens (counted with the target's tokenizer, the same way for every engine), wall seconds, answer
tokens per second and per busy CPU-second of the whole machine (/proc/stat; run nothing else meanwhile),
and how many answers are identical to HF generate's. Writes a JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from eyas.data.atomic import atomic_write_text
from eyas.data.prepare import answer_source, load_corpora
from eyas.data.regenerate import read_answers, regenerate
from eyas.data.targets import Target
from eyas.eval.bench import cpu_sample
from eyas.eval.linear_kernels import tune_linear_kernels
from eyas.recipe import load_recipe

ENGINES = {  # name -> data-section overrides
    "transformers": {"regenerate_engine": "transformers"},
    "vllm-float32": {"regenerate_engine": "vllm", "regenerate_dtype": "float32"},
    "vllm-bfloat16": {"regenerate_engine": "vllm", "regenerate_dtype": "bfloat16"},
}


def run_engine(name: str, recipe, target: Target, records, folder: Path, max_prompt: int) -> dict:
    cfg = dataclasses.replace(recipe.data, **ENGINES[name])  # each engine from the recipe's own settings
    log = folder / f"{name}.jsonl"
    before = cpu_sample()
    t0 = time.perf_counter()
    regenerate(answer_source(cfg, target, folder, max_prompt, tune_linear_kernels), target.tokenizer, records, log,
               cfg.regenerate_max_records, max_prompt_tokens=max_prompt)
    wall = time.perf_counter() - t0
    after = cpu_sample()
    answers = read_answers(log)
    tokens = sum(len(ids) for ids in target.tokenizer(list(answers.values()), add_special_tokens=False)["input_ids"])
    busy = after.machine_busy_s - before.machine_busy_s if before and after else None
    return {"engine": name, "answers": answers, "prompts": len(answers), "answer_tokens": tokens,
            "wall_s": round(wall, 1), "tokens_per_s": round(tokens / wall, 1), "busy_cpu_s": busy and round(busy, 1),
            "tokens_per_cpu_s": busy and round(tokens / busy, 1),
            "concurrency": cfg.regenerate_concurrency if cfg.regenerate_engine == "vllm" else cfg.regenerate_batch_size}


def markdown(rows: list[dict], settings: dict) -> str:
    base = rows[0]
    lines = [f"Regeneration of {base['prompts']} prompts ({settings['recipe']}: prompts <= {settings['max_prompt']} "
             f"tokens, greedy, <= {settings['max_new_tokens']} answer tokens), {time.strftime('%Y-%m-%d')}, "
             f"{settings['cpus']} CPUs, cold start included.", "",
             "| engine | batch / concurrency | answer tokens | wall s | tokens/s | tokens per CPU-s | vs first row "
             "(per CPU-s) | answers identical to first row |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = sum(r["answers"].get(k) == v for k, v in base["answers"].items())
        ratio = r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"] if r["tokens_per_cpu_s"] and base["tokens_per_cpu_s"] else None
        lines.append(f"| {r['engine']} | {r['concurrency']} | {r['answer_tokens']:,} | {r['wall_s']} | "
                     f"{r['tokens_per_s']} | {r['tokens_per_cpu_s']} | {ratio and f'{ratio:.2f}x'} | "
                     f"{same}/{len(base['answers'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="smollm2-135m-cpu")
    ap.add_argument("--prompts", type=int, default=None, help="prompts answered (default: the recipe's)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, first is the reference")
    ap.add_argument("--concurrency", type=int, default=None, help="vLLM requests in flight (default: the recipe's)")
    ap.add_argument("--out", default="runs/bench-regenerate", help="folder for the JSON and markdown")
    args = ap.parse_args(argv)

    recipe = load_recipe(args.recipe)
    cfg = recipe.data
    cfg.regenerate_max_records = args.prompts or cfg.regenerate_max_records
    if args.concurrency:
        cfg.regenerate_concurrency = args.concurrency
    target = Target.resolve(recipe.target)
    records = [r for _, found in load_corpora(cfg) for r in found]
    max_prompt = min(cfg.max_length - cfg.min_assistant_tokens, cfg.regenerate_max_prompt_tokens or 1 << 30)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as tmp:
        for name in args.engines.split(","):
            rows.append(run_engine(name, recipe, target, records, Path(tmp), max_prompt))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "answers"}), flush=True)
    settings = {"recipe": recipe.name, "max_prompt": max_prompt, "max_new_tokens": cfg.regenerate_max_new_tokens,
                "cpus": len(os.sched_getaffinity(0))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, settings)
    atomic_write_text(out / "regenerate.json", json.dumps({"settings": settings, "rows": rows}, indent=1))
    atomic_write_text(out / "regenerate.md", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
