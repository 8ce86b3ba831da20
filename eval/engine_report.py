"""`eyas bench --engine vllm`: the head, exported, served by the engine beside the in-repo bench.

The in-repo bench runs first (it is skipped when up to date); then the head is exported in float32 (the
in-repo decoder's precision, so parity compares like with like), served by vLLM with and without it at
each concurrency level (eval/engine_bench.py), and the engine's acceptance per position is compared
with the in-repo chain's at the same K (eval/engine_parity.py). The engine's figures go into
report.json under `engine` (the gate checks them) and into summary.md; the full run stays in
bench/engine/ (engine.json, engine.md, plots, both server logs).
"""

from __future__ import annotations

from pathlib import Path

from eyas.data.targets import Target
from eyas.eval.engine_bench import EngineBenchConfig, run_engine_bench
from eyas.eval.engine_parity import parity_from_figures, parity_markdown, plot_parity
from eyas.eval.report import REPORT_FILE, load_report, write_report, write_summary
from eyas.heads.export import export_head
from eyas.heads.serving import decoding_settings

ENGINE_DIR = "engine"


def engine_summary(result: dict, parity: dict) -> dict:
    """The engine figures the gate and summary read, from a full engine run and its parity check."""
    c1 = next((lv for lv in result["levels"] if lv["concurrency"] == 1), result["levels"][0])
    acceptance = result["acceptance"]
    return {
        "engine": result["engine"], "engine_version": result["engine_version"],
        "num_speculative_tokens": result["speculative_config"]["num_speculative_tokens"],
        "acceptance_rate": acceptance["acceptance_rate"],
        "mean_acceptance_length": acceptance["mean_acceptance_length"],
        "acceptance_per_position": acceptance["per_position"],
        "by_category": {c: {"acceptance_rate": f["acceptance_rate"]} for c, f in result["by_category"].items()},
        "speedup_c1": result["speedup_c1"],
        "itl_p99_regression_c1": c1["itl_p99_ratio"] - 1 if c1["itl_p99_ratio"] is not None else None,
        "break_even_concurrency": result["break_even_concurrency"],
        "speedup_by_concurrency": {str(lv["concurrency"]): lv["speedup"] for lv in result["levels"]},
        "identical": result["identical"],
        "parity_passed": parity["passed"],
    }


def bench_through_engine(target: Target, head_dir: Path, prompts_path: Path, bench_dir: Path, k: int,
                         cfg: EngineBenchConfig, num_prompts: int | None = None) -> dict:
    """Serve the head of `head_dir` on `target` through vLLM; returns the `engine` section written into report.json."""
    report_path = bench_dir / REPORT_FILE
    report = load_report(report_path)  # the in-repo figures parity is checked against
    out = bench_dir / ENGINE_DIR
    export = export_head(head_dir, "sglang", out / "export", dtype="float32", settings=decoding_settings(k),
                         verifier=target.path)
    cfg.num_speculative_tokens = k  # parity compares the engine's chain with the in-repo chain at the same K
    result = run_engine_bench(target.path, export, prompts_path, out, cfg, num_prompts=num_prompts)
    parity = parity_from_figures(report["chain_acceptance"], result["acceptance"])
    plot_parity(parity, out / "parity.png")
    print(parity_markdown(parity), end="")
    report["engine"] = engine_summary(result, parity)
    write_report(report_path, report)
    write_summary(report, bench_dir / "summary.md")
    return report["engine"]
