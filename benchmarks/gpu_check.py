"""The GPU check of issue 14, in one call: CUDA decoding paths, bf16, head training speed at full size,
the GPU cost model, and `accelerate launch` with FSDP and ZeRO-3.

    python benchmarks/gpu_check.py --out OUT_DIR [--cpu] [--sections a,b] [--budget-s 420]

(scripts/gpu_check.sh wraps it so that `import eyas` works from the checkout without installing it.)
Sections, each timed and guarded (an exception is recorded with its traceback and the next one runs):

    lossless           greedy chain/tree == plain decoding (fp32), bf16 agreement, rejection sampling's test
    train_throughput   head training at Llama-3.1-8B head shape: tokens/s, MFU, peak memory; offline and online
    cost_model         target forward per draft-token count and context, head draft step, decoder overhead,
                       autotune's shapes predicted from those costs against their measured step time
    accelerate_launch  a tiny pipeline (prepare, vocab, collect) and `accelerate launch -m eyas train` with
                       the FSDP and ZeRO-3 configs at one process

Writes OUT_DIR/gpu_check.json (rewritten after every section, so a run cut short still leaves its results)
and OUT_DIR/gpu_check.md. --cpu runs every section at toy sizes on the CPU (the test suite does this).
A section's status: ok, check_failed (it ran, a check did not hold: see `failures`), error (an exception),
skipped-time (the --budget-s had run out before it started).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the gpu_check_* parts beside this file

from gpu_check_common import LLAMA_8B, TINY, Ctx  # noqa: E402

SECTIONS = {
    "lossless": "gpu_check_lossless",
    "train_throughput": "gpu_check_train",
    "cost_model": "gpu_check_cost",
    "accelerate_launch": "gpu_check_launch",
}
REPO = Path(__file__).resolve().parents[1]


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(ctx: Ctx) -> dict:
    import eyas

    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "cpu (reduced)" if ctx.cpu else "gpu",
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or "cpu",
        "python": platform.python_version(),
        "eyas_imported_from": str(Path(eyas.__file__).parent),
        "packages": {n: package_version(n) for n in ("torch", "transformers", "accelerate", "datasets", "deepspeed",
                                                      "safetensors", "numpy")},
        "torch_cuda": torch.version.cuda,
        "shape": dataclasses.asdict(ctx.shape),
    }
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(gpu_memory_gib=props.total_memory / 2 ** 30, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}")
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def run_section(ctx: Ctx, name: str) -> dict:
    """One section, timed; its exception or failed checks are recorded, never raised."""
    start = time.monotonic()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        results = importlib.import_module(SECTIONS[name]).run(ctx)
        failures = results.get("failures") or []
        entry = {"status": "check_failed" if failures else "ok", "results": results}
    except Exception as exc:  # noqa: BLE001 (recorded, and the next section runs)
        entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc(limit=12)}
    entry["seconds"] = round(time.monotonic() - start, 2)
    print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']} s"
          + (f" ({entry['error']})" if "error" in entry else ""), flush=True)
    return entry


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU check ({env.get('mode')})", "",
             f"Run {env.get('date')} on {env.get('device')}, commit {env.get('git_commit')}, "
             f"torch {env['packages'].get('torch')} (CUDA {env.get('torch_cuda')}), "
             f"transformers {env['packages'].get('transformers')}, accelerate {env['packages'].get('accelerate')}, "
             f"deepspeed {env['packages'].get('deepspeed')}. Total {report.get('total_seconds')} s.", "",
             "| section | status | seconds |", "|---|---|---|"]
    for name, entry in report["sections"].items():
        lines.append(f"| {name} | {entry['status']} | {entry.get('seconds', '-')} |")
    for name, entry in report["sections"].items():
        lines += ["", f"## {name}: {entry['status']}", ""]
        if "error" in entry:
            lines += ["```", entry.get("traceback", entry["error"]).rstrip(), "```"]
            continue
        results = entry.get("results") or {}
        for failure in results.get("failures") or []:
            lines.append(f"- FAILED: {failure}")
        try:
            lines += importlib.import_module(SECTIONS[name]).markdown(results)
        except Exception as exc:  # noqa: BLE001 (a summary bug must not lose the JSON)
            lines.append(f"(summary failed: {type(exc).__name__}: {exc}; see gpu_check.json)")
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict) -> None:
    for name, text in (("gpu_check.json", json.dumps(report, indent=2, default=str)),
                       ("gpu_check.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cpu", action="store_true", help="reduced mode: toy sizes on the CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, in this order")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="no section starts after this many seconds (default 420 on GPU, 900 in --cpu mode)")
    args = parser.parse_args(argv)
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; valid: {', '.join(SECTIONS)}")
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --cpu for the reduced CPU mode", file=sys.stderr)
        return 2
    if args.cpu:
        torch.set_num_threads(1)  # toy shapes gain nothing from threads, and a shared CPU loses a lot to them
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "offline")
    budget = args.budget_s or (900.0 if args.cpu else 420.0)
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(device=torch.device("cpu" if args.cpu else "cuda"), cpu=args.cpu, out=args.out,
              deadline=start + budget, shape=TINY if args.cpu else LLAMA_8B)
    report = {"environment": environment(ctx), "budget_s": budget, "sections": {}}
    for name in names:
        if ctx.remaining() <= 0:
            report["sections"][name] = {"status": "skipped-time", "seconds": 0}
            continue
        if name == "accelerate_launch":
            ctx.release()  # the launched processes need the GPU's memory, not the shared 8B target
        report["sections"][name] = run_section(ctx, name)
        report["total_seconds"] = round(time.monotonic() - start, 1)
        write(args.out, report)
    ctx.release()
    report["total_seconds"] = round(time.monotonic() - start, 1)
    write(args.out, report)
    print(f"[gpu_check] wrote {args.out / 'gpu_check.json'} and gpu_check.md in {report['total_seconds']} s", flush=True)
    return 0 if all(e["status"] == "ok" for e in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
