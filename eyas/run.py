"""`eyas run RECIPE`: every stage in order (eyas/stages.py); each stage skips itself when its output is valid.

prepare -> vocab -> collect -> train -> bench -> engine (when asked for) -> gate -> export
"""

from __future__ import annotations

import time
from pathlib import Path

from eyas.data.atomic import atomic_write_json, atomic_write_text
from eyas.data.targets import Target
from eyas.recipe import Recipe, dump_recipe
from eyas.stages import get_stage, run_one, stage_names


def run_all(recipe: Recipe, stages: str | None = None) -> int:
    """Run `stages` (comma-separated; default all) of `recipe`; returns the gate's exit code (0 if no gate)."""
    chosen = [s.strip() for s in stages.split(",")] if stages else stage_names()
    for name in chosen:
        get_stage(name)  # an unknown name fails before anything runs
    recipe.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(recipe.out / "recipe.resolved.yaml", dump_recipe(recipe))
    target = Target.resolve(recipe.target)  # once for every stage of this run
    if "train" in chosen and recipe.head.init_from_target_layer is not None:
        from eyas.train.head_init import check_layer_init  # before prepare and collect spend their time

        check_layer_init(target, recipe.head.init_from_target_layer, recipe.head.hidden_size)
    timings: dict[str, float] = {}
    gate_code = None
    for name in chosen:
        print(f"\n=== eyas {name} ({recipe.name}) ===", flush=True)
        start = time.perf_counter()
        result = run_one(name, recipe, target)
        timings[name] = time.perf_counter() - start
        if name == "gate":
            gate_code = int(result or 0)
        print(f"=== {name} done in {timings[name]:.1f} s", flush=True)
    atomic_write_json(recipe.out / "timings.json", timings)
    print_final_table(recipe, timings, gate_code)
    return gate_code or 0


def print_final_table(recipe: Recipe, timings: dict[str, float], gate_code: int | None) -> None:
    report_path = recipe.stage_dir("bench") / "report.json"
    print("\n" + "=" * 72)
    print(f"eyas run {recipe.name}: {sum(timings.values()) / 60:.1f} min "
          + " ".join(f"{k}={v:.0f}s" for k, v in timings.items()))
    if report_path.exists():
        from eyas.eval.report import load_report

        report = load_report(report_path)
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
    from eyas.data.config import TargetConfig

    target = Target.resolve(TargetConfig(name_or_path=target_dir))
    name = Path(target_dir.rstrip("/")).name.lower()
    recipe = Recipe(name=name, description=f"Starting recipe for {target_dir}", output_dir=f"runs/{name}")
    recipe.target.name_or_path = target_dir
    recipe.target.aux_layer_ids = target.aux_layer_ids
    path = Path(out or f"{name}.yaml")
    header = ("# Written by `eyas recipe new`. Every key is documented in recipes/smollm2-135m-cpu.yaml;\n"
              "# override any with section.key=value on the command line.\n")
    path.write_text(header + dump_recipe(recipe))
    return path
