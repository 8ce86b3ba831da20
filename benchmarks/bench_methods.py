"""Training methods side by side: each variant trains a head on the same stored features, with the same step
budget, and is measured on the same held-out prompts.

    eyas run recipes/smollm2-135m-cpu.yaml --stages prepare,vocab,collect   # or any finished run
    python benchmarks/bench_methods.py                            # every variant below
    python benchmarks/bench_methods.py --variants baseline,ttt-1 --prompts 8 data.regenerate_engine=vllm

Overrides after the options are applied to the recipe for every variant (give those the run was made with).

A variant is a list of `section.key=value` overrides of the recipe's train/head sections (the data, vocab
and features are the recipe's own, read from its output folder and never rewritten). Each trains in its own
process (accelerate's state is per process) into `<out>/<variant>/`; then its best head decodes the held-out
prompts (data/prompts.jsonl, kinds of traffic mixed as the bench picks them) with the in-repo chain decoder at
K = the chain length the bench measures alpha at, greedy, fp32: acceptance (accepted/drafted, vLLM's definition), per
position and per category, and the validation figures of training (accuracy per TTT step, tau_sim).
Acceptance needs no clock, so these figures do not depend on the machine's load; the training seconds do.
method.json also records what the head trained on (`data`: answer tokens, samples, passes over them), which
benchmarks/plot_data_curve.py draws as the data curve.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "baseline": [],
    "epochs-10": ["train.epochs=10"],  # epochs are cheap next to collecting features: do more passes pay?
    "epochs-20": ["train.epochs=20"],
    "ttt-1": ["train.ttt_steps=1"],  # no training-time test: the head only ever sees the target's features
    "ttt-5": ["train.ttt_steps=5"],
    "lm_head-random": ["head.init_lm_head_from_target=false"],
    "lr-2e-4": ["train.lr=2e-4"],
    "lr-1.2e-3": ["train.lr=1.2e-3"],
    "lr-constant": ["train.lr_schedule=constant"],  # no decay after warm-up
    "lr-linear": ["train.lr_schedule=linear"],
    "fp32": ["train.mixed_precision=fp32"],
    "bf16": ["train.mixed_precision=bf16"],
    # What each position is trained towards (train/loss.py draft_loss).
    "loss-hard": ["train.loss=hard"],  # the teacher's argmax only: what greedy serving accepts
    "loss-lk": ["train.loss=lk"],  # the sampled acceptance probability itself
    "loss-kl+lk": ["train.loss=kl+lk"],
    "batch-2": ["train.batch_size=2"],  # twice the optimizer steps for the same tokens
    "mlp-2x": ["head.intermediate_size=3072"],  # a wider head (SmolLM2's MLP is 1,536)
    # The head's normed output regressed onto the target's final hidden state beside the KL (EAGLE-1's feature loss).
    "hidden-0.1": ["train.hidden_loss_weight=0.1"],
    "hidden-1": ["train.hidden_loss_weight=1.0"],
}


def train_variant(recipe_name: str, overrides: list[str], head_dir: Path) -> dict:
    """Train one variant here (called in a child process)."""
    from eyas.data.targets import Target
    from eyas.recipe import load_recipe
    from eyas.train.data import TrainPaths
    from eyas.train.loop import setup, train

    recipe = load_recipe(recipe_name, overrides)
    paths = TrainPaths(recipe.stage_dir("data"), recipe.stage_dir("vocab"), recipe.stage_dir("features"), head_dir)
    t0 = time.perf_counter()
    state = setup(recipe.train, recipe.head, recipe.collect, Target.resolve(recipe.target), paths)
    result = train(state)
    rows = [json.loads(line) for line in (head_dir / "metrics.jsonl").read_text().splitlines()]
    best = max((r for r in rows if r.get("kind") == "val"), key=lambda r: r["tau_sim"])
    return {**result, "train_s": round(time.perf_counter() - t0, 1), "mixed_precision": state.accelerator.mixed_precision,
            "val_step": best["step"], "val_acc": best["step_acc"], "val_tau_sim": best["tau_sim"]}


def acceptance(recipe_name: str, overrides: list[str], head_dir: Path, n_prompts: int,
               prompts_file: str | None = None) -> dict:
    """In-repo chain decoding of the held-out prompts with the head at `head_dir`."""
    import dataclasses

    import torch

    from eyas.data.targets import Target
    from eyas.eval.aggregate import acceptance_figures
    from eyas.eval.bench import chain_config, encode_prompt, read_prompts, select_prompts
    from eyas.eval.decoder import SpeculativeDecoder
    from eyas.heads.checkpoint import load_head
    from eyas.recipe import load_recipe
    from eyas.stages import alpha_chain_length

    recipe = load_recipe(recipe_name, overrides)
    target = Target.resolve(recipe.target)
    k = alpha_chain_length(recipe)
    prompts = select_prompts(read_prompts(Path(prompts_file or recipe.stage_dir("data") / "prompts.jsonl")), n_prompts)
    model = target.load_model()
    head, _ = load_head(head_dir, tokenizer=target.tokenizer, target_vocab_size=target.vocab_size)
    cfg = dataclasses.replace(chain_config(recipe.bench.decoder, k), temperature=0.0)
    decoder = SpeculativeDecoder(model, head.to(model.dtype), target.tokenizer, cfg)
    stats, cats = [], []
    with torch.inference_mode():
        for p in prompts:
            stats.append(decoder.generate(encode_prompt(target.tokenizer, p, model.device)))
            cats.append(p.category)
    overall = acceptance_figures(stats)
    by_cat = {c: acceptance_figures([s for s, sc in zip(stats, cats) if sc == c])["alpha"] for c in sorted(set(cats))}
    # Per prompt too, so a figure can be recomputed without a prompt later found to be unfit.
    per_prompt = [{"line": p.line, "category": c, "draft_tokens": s.draft_tokens,
                   "accepted_tokens": s.accepted_tokens} for p, s, c in zip(prompts, stats, cats)]
    return {"k": k, "prompts": len(prompts), "alpha": overall["alpha"], "draft_tokens": overall["draft_tokens"],
            "per_position": overall["acceptance_rate_per_position"], "by_category": by_cat, "per_prompt": per_prompt}


def data_figures(recipe_name: str, overrides: list[str], steps: int, num_processes: int) -> dict:
    """What the head trained on: the train split's samples and answer (loss-masked) tokens, and the passes over
    them its steps made; benchmarks/plot_data_curve.py draws acceptance against these."""
    from eyas.recipe import load_recipe

    recipe = load_recipe(recipe_name, overrides)
    train_split = json.loads((recipe.stage_dir("data") / "stats.json").read_text())["splits"]["train"]
    collected = json.loads((recipe.stage_dir("features") / "index.json").read_text())["splits"]["train"]
    sequences = steps * recipe.train.batch_size * recipe.train.grad_accum * num_processes
    # collect.max_records can store fewer samples than prepare wrote: the passes are over what was stored.
    return {"train_samples": train_split["samples"], "answer_tokens": train_split["masked_tokens"],
            "collected_samples": collected["num_samples"], "passes": round(sequences / collected["num_samples"], 2)}


def run_one(args) -> int:
    head_dir = Path(args.out) / args.one
    figures = train_variant(args.recipe, args.overrides + VARIANTS[args.one], head_dir)
    figures["data"] = data_figures(args.recipe, args.overrides + VARIANTS[args.one], figures["steps"],
                                   figures["num_processes"])
    figures["acceptance"] = acceptance(args.recipe, args.overrides, head_dir / "best", args.prompts, args.prompts_file)
    (head_dir / "method.json").write_text(json.dumps({"variant": args.one, "overrides": VARIANTS[args.one], **figures},
                                                     indent=1))
    return 0


def _f(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict]) -> str:
    cats = sorted({c for r in rows for c in r["acceptance"]["by_category"]})
    head = ("| variant | overrides | precision | train s | val acc per TTT step | val tau_sim | acceptance | per position | "
            + " | ".join(cats) + " |")
    lines = [head, "|" + "---|" * (8 + len(cats))]
    for r in rows:
        a = r["acceptance"]
        lines.append(f"| {r['variant']} | {' '.join(r['overrides']) or '-'} | {r['mixed_precision']} | {r['train_s']} | "
                     f"{' / '.join(_f(x, '.2f') for x in r['val_acc'][:3])} | {_f(r['val_tau_sim'], '.2f')} | "
                     f"**{_f(a['alpha'])}** | {' / '.join(_f(x) for x in a['per_position'])} | "
                     + " | ".join(_f(a["by_category"].get(c)) for c in cats) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="smollm2-135m-cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts decoded per variant")
    ap.add_argument("--prompts-file", help="held-out prompts JSONL (default: the recipe's data/prompts.jsonl)")
    ap.add_argument("--out", default="runs/bench-methods")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every variant")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: train and measure one variant in this process
    args = ap.parse_args(argv)
    if args.one:
        return run_one(args)
    rows = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        result = Path(args.out) / name / "method.json"
        if not result.exists():  # a finished variant is kept: rerun after a kill continues with the next
            subprocess.run([sys.executable, __file__, "--one", name, "--recipe", args.recipe, "--out", args.out,
                            "--prompts", str(args.prompts),
                            *(["--prompts-file", args.prompts_file] if args.prompts_file else []), *args.overrides],
                           check=True)
        rows.append(json.loads(result.read_text()))
        print(json.dumps({k: rows[-1][k] for k in ("variant", "train_s", "val_tau_sim")} | {
            "alpha": rows[-1]["acceptance"]["alpha"]}), flush=True)
    table = markdown(rows)
    (Path(args.out) / "methods.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
