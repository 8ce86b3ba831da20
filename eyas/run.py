"""`eyas run RECIPE`: every stage in order; each stage skips itself when its output is valid.

prepare -> vocab -> collect (offline mode) -> train -> bench -> gate -> export
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from eyas.recipe import Recipe, dump_recipe

STAGES = ["prepare", "vocab", "collect", "train", "bench", "gate", "export"]


def _stage_fn(name: str):
    if name == "prepare":
        from eyas.data.prepare import run_prepare as fn
    elif name == "vocab":
        from eyas.data.vocab import run_vocab as fn
    elif name == "collect":
        from eyas.data.collect import run_collect as fn
    elif name == "train":
        from eyas.train.loop import run_train as fn
    elif name == "bench":
        from eyas.eval.bench import run_bench as fn
    elif name == "gate":
        from eyas.eval.gate import run_gate

        def fn(recipe: Recipe):
            return run_gate(str(recipe.stage_dir("bench") / "report.json"), recipe=recipe)
    elif name == "export":
        def fn(recipe: Recipe):
            from eyas.heads.export import export_head

            report = recipe.stage_dir("bench") / "report.json"
            outs = []
            for fmt in recipe.export.formats or ["sglang", "speculators"]:
                outs.append(export_head(
                    recipe.stage_dir("head") / "best", fmt, recipe.stage_dir("export") / fmt,
                    report=str(report) if report.exists() else None, dtype=recipe.export.dtype,
                    num_speculative_tokens=recipe.export.num_speculative_tokens,
                    verifier=recipe.target.name_or_path))
            return outs
    else:
        raise ValueError(f"unknown stage '{name}'; stages are {', '.join(STAGES)}")
    return fn


def run_all(recipe: Recipe, stages: str | None = None) -> int:
    chosen = [s.strip() for s in stages.split(",")] if stages else list(STAGES)
    for s in chosen:
        if s not in STAGES:
            raise ValueError(f"unknown stage '{s}'; stages are {', '.join(STAGES)}")
    if recipe.collect.mode == "online" and "collect" in chosen:
        chosen.remove("collect")
    recipe.out.mkdir(parents=True, exist_ok=True)
    (recipe.out / "recipe.resolved.yaml").write_text(dump_recipe(recipe))
    timings: dict[str, float] = {}
    gate_code = None
    for name in chosen:
        print(f"\n=== eyas {name} ({recipe.name}) ===", flush=True)
        start = time.perf_counter()
        result = _stage_fn(name)(recipe)
        timings[name] = time.perf_counter() - start
        if name == "gate":
            gate_code = int(result or 0)
        print(f"=== {name} done in {timings[name]:.1f} s", flush=True)
    (recipe.out / "timings.json").write_text(json.dumps(timings, indent=2))
    print_final_table(recipe, timings, gate_code)
    return gate_code or 0


def print_final_table(recipe: Recipe, timings: dict[str, float], gate_code: int | None) -> None:
    report_path = recipe.stage_dir("bench") / "report.json"
    print("\n" + "=" * 72)
    print(f"eyas run {recipe.name}: {sum(timings.values()) / 60:.1f} min "
          + " ".join(f"{k}={v:.0f}s" for k, v in timings.items()))
    if report_path.exists():
        report = json.loads(report_path.read_text())
        rows = [("all", report)] + sorted((report.get("by_category") or {}).items())
        print(f"{'category':<12}{'alpha':>8}{'tau':>8}{'speedup':>9}{'spec tok/s':>12}{'plain tok/s':>12}")
        for cat, r in rows:
            def f(key, fmt):
                v = r.get(key)
                return format(v, fmt) if isinstance(v, (int, float)) else "-"
            print(f"{cat:<12}{f('alpha', '8.3f')}{f('tau', '8.2f')}{f('speedup', '9.2f')}"
                  f"{f('spec_tokens_per_s', '12.1f')}{f('baseline_tokens_per_s', '12.1f')}")
        print(f"lossless (greedy identical): {report.get('lossless')}")
        print(f"report: {report_path}")
    if gate_code is not None:
        print(f"gate: {'PASS' if gate_code == 0 else 'FAIL (see the table above)'}")
    export = recipe.stage_dir("export")
    if export.exists():
        print(f"exports: {', '.join(str(p) for p in sorted(export.iterdir()) if p.is_dir())}")
    print("=" * 72)


def new_recipe(target_dir: str | None, out: str | None = None) -> Path:
    """Write a starting recipe for any target directory, with every section at its defaults."""
    if not target_dir:
        raise ValueError("eyas recipe new TARGET_DIR: give the target directory or Hub id")
    from transformers import AutoConfig

    from eyas.data.targets import default_aux_layer_ids, resolve_target, text_config

    config = text_config(AutoConfig.from_pretrained(resolve_target(target_dir)))
    name = Path(target_dir.rstrip("/")).name.lower()
    recipe = Recipe(name=name, description=f"Starting recipe for {target_dir}", output_dir=f"runs/{name}")
    recipe.target.name_or_path = target_dir
    recipe.target.aux_layer_ids = default_aux_layer_ids(config.num_hidden_layers)
    path = Path(out or f"{name}.yaml")
    header = ("# Written by `eyas recipe new`. Every key is documented in recipes/smollm2-135m-cpu.yaml;\n"
              "# override any with section.key=value on the command line.\n")
    path.write_text(header + dump_recipe(recipe))
    return path
