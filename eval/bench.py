"""`eyas bench`: plain and speculative decoding of the same target, side by side, on held-out prompts.

Both decoders share one code path (eval/decoder.py), one loaded target, its caches and dtype; they run
alternately per prompt (plain, spec, plain, spec, ...) after a warm-up, so drift in machine load hits both.
Acceptance is counted the way vLLM counts it (pooled over all requests), alpha at the chain length K that
is exported, and losslessness is checked token by token against plain greedy decoding.

    eyas bench smollm2-135m-cpu            # -> runs/.../bench/report.json, summary.md, plots

This module reads the prompts, runs the decoders and writes the outputs; the figures are computed in
eval/aggregate.py and report.json's schema lives in eval/report.py. Main report.json fields (the same
figures again per category under `by_category`):
    tau                  1 + accepted / drafts, pooled over every verify step of every prompt (vLLM's mean
                         acceptance length), for the configured decoder (chain or tree)
    alpha                accepted / proposed draft tokens of a chain of the exported length K (a separate chain
                         pass when the decoder is a tree); alpha_per_position[i] = accepted at depth i / drafts
                         that reached depth i
    *_tokens_per_s       generated tokens / wall time around generate(), summed over prompts
    speedup              spec_tokens_per_s / baseline_tokens_per_s (same target, cache and dtype), with a
                         bootstrap 95% interval over prompts; speedup_vs_hf_generate / _vs_prompt_lookup likewise
    ttft_ms, itl_ms      p50/p90/p99 per decoder; an ITL is the gap between token arrivals, tokens accepted in one
                         verify step arriving together (as a streaming client sees them)
    lossless             greedy speculative tokens == plain tokens on every prompt (exact only in fp32)
    cost_model           verify/draft/other cost per step relative to a plain step, and the speedup that
                         1 + K * alpha tokens per step at those costs predict (and the classic independent-
                         acceptance estimate, predicted_speedup_independent)
    noise                the CPU time other processes took per core while the bench ran (/proc/stat minus this
                         process's own), the load average after, the CPUs, the spread of plain decoding's
                         ms/token across prompts; trustworthy false, with one warning line each, when others'
                         CPU exceeds OTHER_CPU_PER_CORE, the spread SPREAD_CV, or the layout timing stayed
                         inconsistent (also on stderr and at the top of summary.md)
    target.matches_head  whether the head's recorded target hash is this target's (a head trained against
                         other weights is refused unless allow_other_target; then false, and said everywhere)
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from eyas.data.targets import Target
from eyas.eval.aggregate import PromptResult, by_category, per_prompt_rows, summarize
from eyas.eval.config import BenchConfig, DecoderConfig
from eyas.eval.report import REPORT_FILE, make_report, print_summary, write_plots, write_report, write_summary
from eyas.eval.timing import timed
from eyas.heads.checkpoint import HeadMismatchError, head_content_hash, load_head

DEFAULT_CATEGORY = "uncategorized"


# ---- prompts ---------------------------------------------------------------------------------------

class PromptFileError(ValueError):
    """A prompts file line that is not a usable prompt; the message names file, line and field."""


@dataclass
class BenchPrompt:
    line: int  # 1-based line in the prompts file
    category: str
    messages: list[dict] | None = None  # chat prompt, rendered with the target's chat template
    prompt: str | None = None  # completion-style prompt, encoded as is


def _parse_prompt_line(path: Path, line_no: int, text: str) -> BenchPrompt:
    where = f"{path}:{line_no}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected a JSON object with 'prompt' or 'messages', "
                              f"got {type(record).__name__}")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        raise PromptFileError(f"{where}: needs exactly one of the fields 'prompt' (string) or 'messages' "
                              f"(list of {{role, content}}), found keys {sorted(record)}")
    category = record.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category:
        raise PromptFileError(f"{where}: field 'category' must be a non-empty string, got {category!r}")
    if has_prompt:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptFileError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r:.60}")
        return BenchPrompt(line=line_no, category=category, prompt=prompt)
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{where}: field 'messages' must be a non-empty list, got {messages!r:.60}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptFileError(f"{where}: field 'messages[{i}]' must be an object, got {message!r:.60}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise PromptFileError(f"{where}: field 'messages[{i}].{key}' must be a string, "
                                      f"got {message.get(key)!r:.60}")
    if messages[-1]["role"] == "assistant":
        raise PromptFileError(f"{where}: field 'messages[{len(messages) - 1}].role' is 'assistant'; a bench "
                              "prompt ends right before the assistant turn the decoders generate")
    return BenchPrompt(line=line_no, category=category, messages=messages)


def read_prompts(path: str | Path) -> list[BenchPrompt]:
    """Every prompt of a JSONL file (`prompt` or `messages`, optional `category`); blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist (the data stage writes data/prompts.jsonl: "
                                "run `eyas prepare <recipe>`, or pass --prompts)")
    with open(path, encoding="utf-8") as fh:
        prompts = [_parse_prompt_line(path, n, text) for n, text in enumerate(fh, 1) if text.strip()]
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    return prompts


def select_prompts(prompts: Sequence[BenchPrompt], n: int) -> list[BenchPrompt]:
    """The first `n` prompts taken round-robin over categories (in file order), so each category is measured."""
    queues: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        queues.setdefault(p.category, []).append(p)
    chosen: list[BenchPrompt] = []
    while len(chosen) < n and any(queues.values()):
        for queue in queues.values():
            if queue and len(chosen) < n:
                chosen.append(queue.pop(0))
    return sorted(chosen, key=lambda p: p.line)


def encode_prompt(tokenizer, prompt: BenchPrompt, device: torch.device | str = "cpu") -> torch.Tensor:
    """Token ids [1, T]: chat prompts through the target's chat template with the generation prompt appended."""
    if prompt.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptFileError(f"prompt on line {prompt.line} has 'messages' but the target's tokenizer has "
                                  "no chat template; use completion-style 'prompt' records")
        ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(prompt.prompt)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long, device=device)


# ---- running ----------------------------------------------------------------------------------------

def hf_generation_config(model, tokenizer, cfg: DecoderConfig, prompt_lookup: int | None):
    """transformers generate() settings matching the decoders: same length, sampling and end tokens."""
    from transformers import GenerationConfig

    from eyas.eval.decoder import eos_token_ids

    eos = sorted(eos_token_ids(model, tokenizer))  # the decoders' own end tokens
    sample = cfg.temperature > 0
    kwargs = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k) if sample else {}
    return GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=sample, eos_token_id=eos,
                            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
                            prompt_lookup_num_tokens=prompt_lookup, stop_strings=cfg.stop or None, **kwargs)


def hf_generate(model, tokenizer, input_ids: torch.Tensor, gen_config) -> list[int]:
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         generation_config=gen_config, tokenizer=tokenizer)
    return out[0, input_ids.shape[1]:].tolist()


@dataclass
class Runners:
    """Everything that generates, by name, in the order they alternate on each prompt."""
    generators: dict[str, Any]  # name -> callable(input_ids) -> GenerationStats | list[int]
    device: torch.device
    seed: int

    def run_prompt(self, prompt: BenchPrompt, input_ids: torch.Tensor, index: int) -> PromptResult:
        result = PromptResult(prompt=prompt, prompt_tokens=input_ids.shape[1])
        for name, generate in self.generators.items():
            torch.manual_seed(self.seed + index)  # same sampling stream for every decoder on this prompt
            out, wall = timed(lambda: generate(input_ids), self.device)
            result.wall_s[name] = wall
            if isinstance(out, list):
                result.hf_tokens[name] = out
            else:
                result.stats[name] = out
        result.stats.setdefault("chain", result.stats["spec"])
        return result


def chain_config(cfg: DecoderConfig, k: int) -> DecoderConfig:
    """The chain decoder that serving engines run from an export: K greedy draft tokens, no early stop."""
    return dataclasses.replace(cfg, mode="chain", num_speculative_tokens=k, min_draft_prob=0.0)


def build_runners(model, head, tokenizer, cfg: DecoderConfig, bench: BenchConfig, k_alpha: int) -> Runners:
    from eyas.eval.decoder import PlainDecoder, SpeculativeDecoder

    plain = PlainDecoder(model, tokenizer, cfg)
    spec = SpeculativeDecoder(model, head, tokenizer, cfg)
    generators: dict[str, Any] = {"plain": plain.generate, "spec": spec.generate}
    chain_cfg = chain_config(cfg, k_alpha)
    if chain_cfg != cfg:
        generators["chain"] = SpeculativeDecoder(model, head, tokenizer, chain_cfg).generate
    if bench.compare_hf:
        greedy = hf_generation_config(model, tokenizer, cfg, None)
        lookup = hf_generation_config(model, tokenizer, cfg, bench.prompt_lookup_num_tokens)
        generators["hf_generate"] = lambda ids: hf_generate(model, tokenizer, ids, greedy)
        generators["prompt_lookup"] = lambda ids: hf_generate(model, tokenizer, ids, lookup)
    return Runners(generators=generators, device=model.device, seed=bench.seed)


def tune_decoder(model, head, tokenizer, cfg: DecoderConfig, all_prompts: Sequence[BenchPrompt],
                 chosen: Sequence[BenchPrompt], count: int) -> tuple[DecoderConfig, dict]:
    """Pick the draft shape on prompts the bench does not measure, when the file has any (else on measured
    ones, and the report says so), so the speedup is not selected on its own test set."""
    from eyas.eval.autotune import autotune

    measured = {p.line for p in chosen}
    held_out = [p for p in all_prompts if p.line not in measured][:count]
    tune_on = held_out or list(chosen[:count])
    ids = [encode_prompt(tokenizer, p, model.device) for p in tune_on]
    tuned, table = autotune(model, head, tokenizer, ids, cfg, max_new_tokens=min(cfg.max_new_tokens, 64))
    return tuned, {"table": table, "prompt_lines": [p.line for p in tune_on], "held_out": bool(held_out)}


def tune_kernels(bench: BenchConfig, model, head) -> list[dict]:
    """bench.linear_kernels auto: install the faster CPU matmul layout per row count (both decoders use it)."""
    if bench.linear_kernels != "auto":
        return []
    from eyas.eval.linear_kernels import format_kernel_table, tune_linear_kernels

    table = tune_linear_kernels(model, head)
    if table:
        print("[bench] linear layout per row count (target + head, one pass over all layers):\n"
              + format_kernel_table(table), flush=True)
    return table


# ---- how far the timings can be trusted ----------------------------------------------------------

OTHER_CPU_PER_CORE = 0.25  # CPU time of other processes per core during the bench above which timings are doubtful
SPREAD_CV = 0.25  # plain decoding's ms/token varying more than this across prompts is noise, not prompts


@dataclass(frozen=True)
class CpuSample:
    """Wall clock, busy CPU seconds of the whole machine and CPU seconds of this process, at one moment."""

    wall: float
    machine_busy_s: float
    own_s: float


def cpu_sample() -> CpuSample | None:
    """Now, from /proc/stat and os.times() (None off Linux). Two samples tell how much CPU *other*
    processes used in between: unlike a load average, the bench's own threads and whatever this process
    ran just before (the train stage of `eyas run`) do not count."""
    try:
        with open("/proc/stat") as fh:
            ticks = [int(v) for v in fh.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        per_s = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    own = os.times()
    return CpuSample(time.monotonic(), (sum(ticks) - ticks[3] - ticks[4]) / per_s,
                     own.user + own.system + own.children_user + own.children_system)


def load_average() -> tuple[float, float, float] | None:
    try:
        return tuple(os.getloadavg())
    except (OSError, AttributeError):  # a platform without it
        return None


def measurement_noise(before: CpuSample | None, after: CpuSample | None, cpus: int, plain_s_per_token: Sequence[float],
                      layout_warnings: Sequence[str] = (), load_after=None) -> dict:
    """The report's `noise`: how much CPU other processes took during the bench, the run-to-run spread of plain
    decoding, and whether (with the layout tuning's own doubts) they leave the timings trustworthy."""
    other = None
    if before is not None and after is not None and after.wall > before.wall:
        others_s = (after.machine_busy_s - before.machine_busy_s) - (after.own_s - before.own_s)
        other = max(0.0, others_s / (after.wall - before.wall)) / max(cpus, 1)
    ms = [1e3 * s for s in plain_s_per_token]
    cv = statistics.pstdev(ms) / statistics.mean(ms) if len(ms) > 1 and statistics.mean(ms) > 0 else None
    warnings = []
    if other is not None and other > OTHER_CPU_PER_CORE:
        warnings.append(f"other processes used {other:.2f} of each of the {cpus} CPUs while the bench ran "
                        f"(above {OTHER_CPU_PER_CORE}): they competed for the CPUs")
    if cv is not None and cv > SPREAD_CV:
        warnings.append(f"plain decoding's ms per token spread {cv:.0%} across prompts (coefficient of variation; "
                        f"a steady machine stays under {SPREAD_CV:.0%})")
    warnings += [f"matmul layout timing: {w}" for w in layout_warnings]
    return {"cpus": cpus, "other_cpu_per_core": other, "load_after": list(load_after) if load_after else None,
            "plain_ms_per_token_cv": cv, "trustworthy": not warnings, "warnings": warnings}


def plain_seconds_per_token(results: Sequence[PromptResult]) -> list[float]:
    """Plain decoding's time per token after the first, per prompt: the same work each time, so its spread is noise."""
    out = []
    for r in results:
        s = r.stats["plain"]
        if len(s.tokens) > 1:
            out.append((r.wall_s["plain"] - s.ttft_s) / (len(s.tokens) - 1))
    return out


def measure(model, head, tokenizer, bench: BenchConfig, all_prompts: list[BenchPrompt], k_alpha: int
            ) -> tuple[list[PromptResult], DecoderConfig, dict | None]:
    """(one result per measured prompt, the decoder measured, the autotune table or None)."""
    from tqdm.auto import tqdm

    from eyas.eval.autotune import WARMUP_TOKENS

    chosen = select_prompts(all_prompts, bench.num_prompts)
    encoded = [encode_prompt(tokenizer, p, model.device) for p in chosen]
    warmup_ids = [encode_prompt(tokenizer, p, model.device) for p in all_prompts[:bench.warmup]]
    cfg, tune_table = bench.decoder, None
    if bench.autotune:
        cfg, tune_table = tune_decoder(model, head, tokenizer, cfg, all_prompts, chosen, max(bench.warmup, 2))
    runners = build_runners(model, head, tokenizer, cfg, bench, k_alpha)
    with torch.inference_mode():
        # Short warm-up runs reach the same kernels and caches as the measured ones.
        warm = build_runners(model, head, tokenizer, dataclasses.replace(cfg, max_new_tokens=WARMUP_TOKENS), bench,
                             k_alpha)
        for i, ids in enumerate(tqdm(warmup_ids, desc="bench warm-up", leave=False)):
            warm.run_prompt(chosen[0], ids, -1 - i)
        results = []
        bar = tqdm(list(zip(chosen, encoded)), desc="bench", unit="prompt")
        for i, (prompt, ids) in enumerate(bar):
            results.append(runners.run_prompt(prompt, ids, i))
            spec_s = sum(r.wall_s["spec"] for r in results)
            plain_s = sum(r.wall_s["plain"] for r in results)
            tokens = sum(len(r.stats["spec"].tokens) for r in results)
            base_tokens = sum(len(r.stats["plain"].tokens) for r in results)
            bar.set_postfix(speedup=f"{(tokens / spec_s) / (base_tokens / plain_s):.2f}x"
                            if spec_s > 0 and plain_s > 0 and base_tokens else "-")
    return results, cfg, tune_table


# ---- the stage --------------------------------------------------------------------------------------

def check_target_weights(head_dir: Path, meta: dict, target: Target, allow_other_target: bool) -> bool | None:
    """Whether the head was trained against this target's weights (None: it records no target hash).

    Other weights are refused (its drafts would be measured against a model it never saw), or with
    `allow_other_target` said loudly on stderr and marked in the report."""
    recorded = meta.get("target_hash")
    if not recorded or recorded == target.hash:
        return None if not recorded else True
    message = (f"{head_dir}: head was trained against target weights {recorded[:12]} ({meta.get('target', '?')}), "
               f"{target.name} has {target.hash[:12]}: other weights than the head was trained against")
    if not allow_other_target:
        raise HeadMismatchError(f"{message}; acceptance would say nothing about the head (to measure it there "
                                "anyway, allow it: --allow-other-target)")
    print(f"eyas bench: WARNING: {message}; measuring anyway, and the report is marked", file=sys.stderr)
    return False


def bench(cfg: BenchConfig, target: Target, head_dir: Path, prompts_path: Path, out: Path,
          k_alpha: int, allow_other_target: bool = False) -> dict | None:
    """Benchmark the head in `head_dir` against plain decoding of `target` on the prompts of `prompts_path`,
    alpha at chain length `k_alpha`; writes report.json, summary.md and plots into `out`.

    Everything that can be refused without the model is checked before it loads: the prompts file, the
    decoder settings, the head against the target's tokenizer, vocabulary and weights (other weights only
    with `allow_other_target`, and marked in the report).
    """
    from eyas.eval.decoder import check_decoder_config

    head_dir, out = Path(head_dir), Path(out)
    all_prompts = read_prompts(prompts_path)
    check_decoder_config(cfg.decoder)
    head_hash = head_content_hash(head_dir)  # before loading: the hash names what was read
    head, meta = load_head(head_dir, tokenizer=target.tokenizer, target_vocab_size=target.vocab_size)
    matches_head = check_target_weights(head_dir, meta, target, allow_other_target)
    cpu_before = cpu_sample()  # others' CPU time is counted from here to the end of the measurement
    model = target.load_model()
    head = head.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
    kernel_table = tune_kernels(cfg, model, head)
    results, decoder, tune_table = measure(model, head, target.tokenizer, cfg, all_prompts, k_alpha)
    noise = measurement_noise(cpu_before, cpu_sample(), os.cpu_count() or 1, plain_seconds_per_token(results),
                              [f"{t['note']} at {t['rows']} row(s)" for t in kernel_table if not t["consistent"]],
                              load_after=load_average())
    for warning in noise["warnings"]:
        print(f"eyas bench: WARNING: {warning}; the figures are marked untrustworthy", file=sys.stderr)

    greedy = decoder.temperature == 0
    figures = summarize(results, greedy, k_alpha)
    exact_expected = greedy and model.dtype == torch.float32
    dtype = str(model.dtype).removeprefix("torch.")
    device = model.device
    report = make_report({
        **figures,
        "lossless_exact_expected": exact_expected,
        "lossless_note": figures.get("lossless_note") or (
            "fp32 greedy: speculative output must equal plain output exactly" if exact_expected else
            f"{dtype}: a multi-token verify forward rounds differently from one-token decoding, so a "
            "divergence can be kernel numerics; see token_agreement"),
        "by_category": by_category(results, greedy, k_alpha),
        "per_prompt": per_prompt_rows(results, greedy),
        "decoder": dataclasses.asdict(decoder),
        "alpha_chain_length": k_alpha,
        "autotune": tune_table,
        "bench": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "decoder"},
        "head": {"path": str(head_dir.resolve()), "sha256": head_hash},
        "target": {"name": target.name, "sha256": target.hash, "tokenizer_sha256": target.tokenizer_hash,
                   "matches_head": matches_head, "head_target_sha256": meta.get("target_hash")},
        "noise": noise,
        "prompts_file": str(Path(prompts_path).resolve()),
        "environment": {"device": str(device), "dtype": dtype, "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "linear_kernels": kernel_table,
                        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "created_unix": time.time(),
    })
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = [p.name for p in write_plots(report, out)]
    write_summary(report, out / "summary.md")
    write_report(out / REPORT_FILE, report)
    print_summary(report)
    return {"head_sha256": head_hash}
