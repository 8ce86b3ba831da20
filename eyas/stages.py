"""The pipeline's stages, each declared once: its folder, config sections, upstream stages, code, run.

    prepare -> vocab -> collect -> train -> bench -> engine -> gate -> export

`eyas run` walks STAGES in order; `eyas prepare|vocab|collect|train|bench` run one. Every cached
stage goes through `run_stage` (data/stage.py): it is skipped when its DONE.json records the same
inputs (config sections, upstream hashes, named input files, the stage's own code) and redone, with
everything after it, when any of those change.

Each `run` adapter is where the recipe stops: it hands the stage function its own config sections,
the resolved Target and its folders, never the whole recipe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.data.stage import Stage, input_hash, run_stage
from eyas.data.targets import Target
from eyas.recipe import Recipe


def _prepare(recipe: Recipe, target: Target, out: Path, **_) -> dict | None:
    from eyas.data.prepare import prepare
    from eyas.eval.linear_kernels import tune_linear_kernels

    # Regeneration decodes batches of regenerate_batch_size rows: on the CPU give those the faster matmul layout.
    return prepare(recipe.data, target, out, tune_for_rows=tune_linear_kernels)


def _prepare_inputs(recipe: Recipe) -> dict:
    from eyas.data.corpora import corpus_identity

    return {"corpora": [corpus_identity(c) for c in recipe.data.corpora]}


def _vocab(recipe: Recipe, target: Target, out: Path, **_) -> dict | None:
    from eyas.data.vocab import build_vocab

    return build_vocab(recipe.vocab, target, recipe.stage_dir("data"), out)


def _collect(recipe: Recipe, target: Target, out: Path, **_) -> dict | None:
    from eyas.data.collect import collect

    return collect(recipe.collect, target, recipe.stage_dir("data"), recipe.stage_dir("vocab"), out)


def _train(recipe: Recipe, target: Target, out: Path, **_) -> dict | None:
    from eyas.train.loop import TrainPaths, setup, train

    paths = TrainPaths(data=recipe.stage_dir("data"), vocab=recipe.stage_dir("vocab"),
                       features=recipe.stage_dir("features"), head=out)
    return train(setup(recipe.train, recipe.head, recipe.collect, target, paths, run_name=recipe.name))


def bench_head_dir(recipe: Recipe, head: str | None = None) -> Path:
    return Path(head) if head else recipe.stage_dir("head") / "best"


def bench_prompts_path(recipe: Recipe, prompts: str | None = None) -> Path:
    return Path(prompts or recipe.bench.prompts or recipe.stage_dir("data") / "prompts.jsonl")


def alpha_chain_length(recipe: Recipe) -> int:
    """The chain length K at which alpha is measured: the one that will be served."""
    return (recipe.bench.alpha_chain_length or recipe.export.num_speculative_tokens
            or recipe.bench.decoder.num_speculative_tokens)


def _bench(recipe: Recipe, target: Target, out: Path, head: str | None = None, prompts: str | None = None,
           allow_other_target: bool = False, **_) -> dict | None:
    from eyas.eval.bench import bench

    return bench(recipe.bench, target, bench_head_dir(recipe, head), bench_prompts_path(recipe, prompts), out,
                 alpha_chain_length(recipe), allow_other_target=allow_other_target)


def _bench_inputs(recipe: Recipe, head: str | None = None, prompts: str | None = None,
                  allow_other_target: bool = False) -> dict:
    from eyas.data.packages import sha256_file
    from eyas.heads.checkpoint import head_content_hash

    prompts_path = bench_prompts_path(recipe, prompts)
    if not prompts_path.is_file():
        raise FileNotFoundError(f"bench prompts {prompts_path} do not exist (run `eyas prepare` or set bench.prompts)")
    # A run allowed on other target weights is marked so; it never stands in for a normal run.
    return {"head": head_content_hash(bench_head_dir(recipe, head)), "prompts": sha256_file(prompts_path),
            "k": alpha_chain_length(recipe), "allow_other_target": allow_other_target}


def _engine(recipe: Recipe, target: Target, out: Path, head: str | None = None, prompts: str | None = None,
            **_) -> dict | None:
    from eyas.eval.engine_bench import EngineBenchConfig
    from eyas.eval.engine_report import bench_through_engine

    cfg = EngineBenchConfig(concurrency=list(recipe.engine.concurrency), max_tokens=recipe.engine.max_tokens,
                            structured=recipe.engine.structured, enforce_eager=not recipe.engine.compile)
    engine = bench_through_engine(target, bench_head_dir(recipe, head), bench_prompts_path(recipe, prompts),
                                  out.parent, alpha_chain_length(recipe), cfg, num_prompts=recipe.bench.num_prompts)
    return {"acceptance_rate": engine["acceptance_rate"], "speedup_c1": engine["speedup_c1"]}


def _gate(recipe: Recipe, target: Target | None, out: Path, **_) -> int:
    from eyas.eval.gate import run_gate

    return run_gate(out / "report.json", recipe.gate)


def _export(recipe: Recipe, target: Target | None, out: Path, **_) -> list[Path]:
    from eyas.eval.report import serving_settings
    from eyas.heads.export import export_head

    settings = serving_settings(recipe.stage_dir("bench") / "report.json", recipe.export.num_speculative_tokens)
    return [export_head(recipe.stage_dir("head") / "best", fmt, out / fmt, dtype=recipe.export.dtype,
                        settings=settings, verifier=recipe.target.name_or_path)
            for fmt in recipe.export.formats]


DATA_CODE = ("eyas.data.corpora", "eyas.data.templates", "eyas.data.config", "eyas.data.targets")

STAGES: list[Stage] = [
    Stage("prepare", folder="data", sections=("target", "data"), upstream=(),
          code=DATA_CODE + ("eyas.data.prepare", "eyas.data.regenerate", "eyas.data.engine"), run=_prepare,
          inputs=_prepare_inputs),
    Stage("vocab", folder="vocab", sections=("target", "vocab"), upstream=("prepare",),
          code=("eyas.data.vocab", "eyas.data.config"), run=_vocab),
    Stage("collect", folder="features", sections=("target", "collect"), upstream=("prepare", "vocab"),
          code=("eyas.data.collect", "eyas.data.features", "eyas.data.config", "eyas.data.targets"), run=_collect),
    Stage("train", folder="head", sections=("target", "collect", "head", "train"), upstream=("prepare", "vocab", "collect"),
          code=("eyas.train.loop", "eyas.train.data", "eyas.train.resume", "eyas.train.loss", "eyas.train.config",
                "eyas.heads.eagle3", "eyas.data.features"),
          run=_train),
    Stage("bench", folder="bench", sections=("target", "bench"), upstream=(),
          code=("eyas.eval.bench", "eyas.eval.aggregate", "eyas.eval.report", "eyas.eval.decoder", "eyas.eval.autotune",
                "eyas.eval.target_runner", "eyas.eval.kv_cache", "eyas.eval.timing", "eyas.eval.sampling",
                "eyas.eval.linear_kernels", "eyas.eval.config"),
          run=_bench, inputs=_bench_inputs),
    # The head served by the engine (when `engine.name` is set): its figures go into bench/report.json.
    Stage("engine", folder="bench/engine", sections=("target", "engine"), upstream=("bench",),
          code=("eyas.eval.engine_report", "eyas.eval.engine_bench", "eyas.eval.engine_parity", "eyas.data.engine",
                "eyas.eval.metrics_text"), run=_engine, enabled=lambda recipe: recipe.engine.name is not None),
    # The gate reads one JSON and the export rewrites two small folders: cheap, so never skipped.
    Stage("gate", folder="bench", sections=("gate",), upstream=("bench",), code=(), run=_gate, cached=False),
    Stage("export", folder="export", sections=("export",), upstream=("train",), code=(), run=_export, cached=False),
]
BY_NAME = {s.name: s for s in STAGES}


def stage_names() -> list[str]:
    return [s.name for s in STAGES]


def get_stage(name: str) -> Stage:
    if name not in BY_NAME:
        raise ValueError(f"unknown stage '{name}'; stages are {', '.join(stage_names())}")
    return BY_NAME[name]


def run_one(name: str, recipe: Recipe, target: Target | None = None, **options) -> Any:
    """Run stage `name` of `recipe` (skipped when up to date). `options` reach the adapter (bench --head)."""
    stage = get_stage(name)
    out = recipe.stage_dir(stage.folder)
    if stage.enabled is not None and not stage.enabled(recipe):
        print(f"[{name}] not asked for by this recipe; skipped", flush=True)
        return None
    if target is None and stage.cached:
        target = Target.resolve(recipe.target)
    if not stage.cached:
        return stage.run(recipe, target, out, **options)
    sections = {s: getattr(recipe, s) for s in stage.sections}
    upstream = {u: recipe.stage_dir(get_stage(u).folder) for u in stage.upstream}
    # The target's content counts too: the same name can hold other weights (a re-converted or edited dir).
    extra = {"target": target.hash, **(stage.inputs(recipe, **options) if stage.inputs else {})}
    key = input_hash(stage, sections, upstream, extra)
    return run_stage(stage, out, key, lambda: stage.run(recipe, target, out, **options))
