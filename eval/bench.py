"""`eyas bench`: plain and speculative decoding of the same target, side by side, on held-out prompts.

Both decoders share one code path (eval/decoder.py), one loaded target, its caches and dtype; they run
alternately per prompt (plain, spec, plain, spec, ...) after a warm-up, so drift in machine load hits both.
Acceptance is counted the way vLLM counts it (pooled over all requests), alpha at the chain length that is
exported, and losslessness is checked token by token against plain greedy decoding.

    report = run_bench(load_recipe("smollm2-135m-cpu"))   # -> runs/.../bench/report.json

Main report.json fields (the same figures again per category under `by_category`):
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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from eyas.data.packages import sha256_file
from eyas.data.prepare import DONE, read_done, write_done
from eyas.data.targets import load_target, target_hash, text_config, tokenizer_hash
from eyas.eval.config import BenchConfig, DecoderConfig
from eyas.heads.checkpoint import WEIGHTS, head_content_hash, load_head

PERCENTILES = (50, 90, 99)
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


# ---- aggregation ------------------------------------------------------------------------------------

def percentiles(values: Sequence[float], qs: Sequence[int] = PERCENTILES, scale: float = 1.0) -> dict:
    """{"p50": .., "p90": .., "p99": ..} with linear interpolation (numpy's default, as vLLM reports); None if empty."""
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def inter_token_latencies(token_times_s: Sequence[float]) -> list[float]:
    """Gaps between successive token arrivals. Tokens that a verify step accepts together arrive at the same
    time and count as one arrival, as in a streaming client (vLLM's benchmark measures ITL per chunk)."""
    arrivals = sorted(set(float(t) for t in token_times_s))
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def _pooled(lists: Sequence[Sequence[float]]) -> list[float]:
    """Element-wise sum of lists of different lengths."""
    out: list[float] = []
    for values in lists:
        for i, v in enumerate(values or []):
            if i == len(out):
                out.append(0)
            out[i] += v
    return out


def acceptance_figures(stats: Sequence[Any]) -> dict:
    """Draft acceptance pooled over prompts, as vLLM counts it.

    tau = 1 + accepted / drafts over all verify steps of all prompts (the mean of per-prompt means weights a
    short answer like a long one, so it is reported beside it only for comparison); alpha = accepted draft
    tokens / proposed draft tokens; alpha_per_position[i] = accepted at depth i / drafts that proposed depth
    i with every earlier draft token accepted (conditional acceptance).
    """
    drafts = sum(s.drafts for s in stats)
    draft_tokens = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    accepted_pos = _pooled([s.accepted_per_position for s in stats])
    reached_pos = _pooled([s.reached_per_position for s in stats])
    per_prompt_tau = [1 + s.accepted_tokens / s.drafts for s in stats if s.drafts]
    forwards = sum(s.target_forwards for s in stats)
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "tau": 1 + accepted / drafts if drafts else None,
        "tau_mean_of_prompts": float(np.mean(per_prompt_tau)) if per_prompt_tau else None,
        "alpha": accepted / draft_tokens if draft_tokens else None,
        "alpha_per_position": [a / r if r else None for a, r in zip(accepted_pos, reached_pos)],
        # vLLM's per-position acceptance rate: accepted at depth i / all drafts.
        "acceptance_rate_per_position": [a / drafts if drafts else None for a in accepted_pos],
        "accepted_per_position": accepted_pos,
        "reached_per_position": reached_pos,
        # SGLang's accept length: generated tokens per target forward (prefill included).
        "tokens_per_target_forward": sum(len(s.tokens) for s in stats) / forwards if forwards else None,
    }


def speed_figures(stats: Sequence[Any], wall_s: Sequence[float]) -> dict:
    """Throughput and latency of one decoder over prompts; wall times are measured around generate()."""
    tokens = sum(len(s.tokens) for s in stats)
    total_wall = float(sum(wall_s))
    itl = [gap for s in stats for gap in inter_token_latencies(s.token_times_s)]
    # Time per output token after the first, per prompt (vLLM's TPOT).
    tpot = [(w - s.ttft_s) / (len(s.tokens) - 1) for s, w in zip(stats, wall_s) if len(s.tokens) > 1]
    split = {part: float(sum(getattr(s, f"time_{part}_s") for s in stats)) for part in ("target", "draft", "other")}
    return {
        "prompts": len(stats),
        "new_tokens": tokens,
        "wall_s": total_wall,
        "tokens_per_s": tokens / total_wall if total_wall > 0 else None,
        "ttft_ms": percentiles([s.ttft_s for s in stats], scale=1e3),
        "itl_ms": percentiles(itl, scale=1e3),
        "tpot_ms": percentiles(tpot, scale=1e3),
        "target_forwards": int(sum(s.target_forwards for s in stats)),
        "time_s": split,
        "time_ms_per_token": {k: 1e3 * v / tokens if tokens else None for k, v in split.items()},
    }


def token_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Share of the reference tokens reproduced before the first divergence (1.0 = identical)."""
    if not reference and not other:
        return 1.0
    same = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        same += 1
    return same / max(len(reference), len(other))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def speedup_interval(spec_tokens: Sequence[int], spec_s: Sequence[float], plain_tokens: Sequence[int],
                     plain_s: Sequence[float], samples: int = 1000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval of the speedup over prompts: how much the figure moves with the prompt sample."""
    n = len(spec_tokens)
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))
    st, ss, pt, ps = (np.asarray(x, dtype=np.float64)[idx].sum(1) for x in (spec_tokens, spec_s, plain_tokens, plain_s))
    ratios = (st / ss) / (pt / ps)
    ratios = ratios[np.isfinite(ratios)]
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))] if ratios.size else None


def predicted_speedup(alpha: float, k: int, verify_cost: float = 1.0, draft_cost: float = 0.0,
                      other_cost: float = 0.0, tokens_per_step: float | None = None) -> float | None:
    """Tokens per step over the cost of a step (one verify forward + K draft forwards + overhead), all costs
    relative to one plain decoding step. Without `tokens_per_step`, the classic estimate for a per-token
    acceptance probability alpha that is the same at every depth: (1 - alpha^(K+1)) / (1 - alpha)."""
    if tokens_per_step is None:
        tokens_per_step = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    cost = verify_cost + k * draft_cost + other_cost
    return tokens_per_step / cost if cost > 0 else None  # no measured cost: no prediction


def cost_model(plain: Sequence[Any], plain_wall: Sequence[float], chain: Sequence[Any], alpha: float | None,
               k: int) -> dict:
    """Measured step costs of the chain decoder relative to a plain step, and the speedup they predict.

    Prefill is taken out of both sides: its cost is the plain decoder's time to first token on the same
    prompt (identical computation), so what is compared is the per-step cost of the decode phase.
    """
    plain_steps = sum(max(s.target_forwards - 1, 0) for s in plain)
    plain_decode_s = sum(w - s.ttft_s for s, w in zip(plain, plain_wall))
    chain_steps = sum(max(s.target_forwards - 1, 0) for s in chain)
    if not plain_steps or not chain_steps or alpha is None or plain_decode_s <= 0:
        return {}
    plain_step = plain_decode_s / plain_steps
    verify_s = sum(c.time_target_s - min(p.ttft_s, c.time_target_s) for c, p in zip(chain, plain))
    draft_forwards = sum(c.draft_tokens for c in chain)  # a chain runs the head once per draft token
    verify_cost = verify_s / chain_steps / plain_step
    draft_cost = (sum(c.time_draft_s for c in chain) / draft_forwards / plain_step) if draft_forwards else 0.0
    other_cost = sum(c.time_other_s for c in chain) / chain_steps / plain_step
    # alpha is accepted / drafted over chain steps of K drafts, so a step yields 1 + K * alpha tokens on
    # average: measured, not the classic formula (acceptances at successive depths are far from independent).
    tokens = 1 + k * alpha
    return {
        "k": k,
        "alpha": alpha,
        "plain_step_ms": 1e3 * plain_step,
        "verify_cost": verify_cost,
        "draft_cost": draft_cost,
        "other_cost": other_cost,
        "expected_tokens_per_step": tokens,
        "predicted_speedup_free_draft": tokens,
        "predicted_speedup": predicted_speedup(alpha, k, verify_cost, draft_cost, other_cost, tokens_per_step=tokens),
        "predicted_speedup_independent": predicted_speedup(alpha, k, verify_cost, draft_cost, other_cost),
    }


# ---- one prompt, every decoder --------------------------------------------------------------------

@dataclass
class PromptResult:
    prompt: BenchPrompt
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # decoder name -> GenerationStats
    wall_s: dict[str, float] = field(default_factory=dict)  # runner name -> seconds around generate()
    hf_tokens: dict[str, list[int]] = field(default_factory=dict)  # hf runner name -> generated ids


def summarize(results: Sequence[PromptResult], greedy: bool, k_alpha: int) -> dict:
    """Every figure of the report for a set of prompts (all of them, or one category)."""
    plain = [r.stats["plain"] for r in results]
    spec = [r.stats["spec"] for r in results]
    chain = [r.stats["chain"] for r in results]
    plain_speed = speed_figures(plain, [r.wall_s["plain"] for r in results])
    spec_speed = speed_figures(spec, [r.wall_s["spec"] for r in results])
    main = acceptance_figures(spec)
    chain_acc = acceptance_figures(chain)
    out = {
        "prompts": len(results),
        "tau": main["tau"],
        "tau_mean_of_prompts": main["tau_mean_of_prompts"],
        "alpha": chain_acc["alpha"],
        "alpha_per_position": chain_acc["alpha_per_position"],
        "spec_tokens_per_s": spec_speed["tokens_per_s"],
        "baseline_tokens_per_s": plain_speed["tokens_per_s"],
        "speedup": ratio(spec_speed["tokens_per_s"], plain_speed["tokens_per_s"]),
        "speedup_ci95": speedup_interval([len(s.tokens) for s in spec], [r.wall_s["spec"] for r in results],
                                         [len(s.tokens) for s in plain], [r.wall_s["plain"] for r in results]),
        "ttft_ms": {"baseline": plain_speed["ttft_ms"], "spec": spec_speed["ttft_ms"]},
        "itl_ms": {"baseline": plain_speed["itl_ms"], "spec": spec_speed["itl_ms"]},
        "itl_p99_regression": ratio(spec_speed["itl_ms"]["p99"], plain_speed["itl_ms"]["p99"]) - 1
        if spec_speed["itl_ms"]["p99"] is not None and plain_speed["itl_ms"]["p99"] else None,
        "acceptance": main,
        "chain_acceptance": chain_acc,
        "baseline": plain_speed,
        "spec": spec_speed,
    }
    if any(r.stats["chain"] is not r.stats["spec"] for r in results):
        chain_speed = speed_figures(chain, [r.wall_s["chain"] for r in results])
        out["chain"] = chain_speed
        out["chain_speedup"] = ratio(chain_speed["tokens_per_s"], plain_speed["tokens_per_s"])
    else:
        out["chain_speedup"] = out["speedup"]
    out["cost_model"] = cost_model(plain, [r.wall_s["plain"] for r in results], chain, chain_acc["alpha"], k_alpha)
    for name in ("hf_generate", "prompt_lookup"):
        if all(name in r.wall_s for r in results) and results:
            tokens = sum(len(r.hf_tokens[name]) for r in results)
            wall = sum(r.wall_s[name] for r in results)
            out[f"{name}_tokens_per_s"] = tokens / wall if wall > 0 else None
            out[f"speedup_vs_{name}"] = ratio(spec_speed["tokens_per_s"], out[f"{name}_tokens_per_s"])
        else:
            out[f"{name}_tokens_per_s"] = None
            out[f"speedup_vs_{name}"] = None
    out.update(lossless_figures(results, greedy))
    return out


def lossless_figures(results: Sequence[PromptResult], greedy: bool) -> dict:
    """Greedy speculative output must equal plain greedy output token for token (exact in fp32)."""
    if not greedy:
        return {"lossless": None, "lossless_note": "sampling (temperature > 0): outputs are not comparable "
                                                   "token by token"}
    spec_same = [r.stats["spec"].tokens == r.stats["plain"].tokens for r in results]
    chain_same = [r.stats["chain"].tokens == r.stats["plain"].tokens for r in results]
    agreement = [token_agreement(r.stats["plain"].tokens, r.stats["spec"].tokens) for r in results]
    out = {
        "lossless": all(spec_same) and all(chain_same),
        "lossless_prompts": sum(a and b for a, b in zip(spec_same, chain_same)),
        "token_agreement": float(np.mean(agreement)) if agreement else None,
    }
    hf = [token_agreement(r.stats["plain"].tokens, r.hf_tokens["hf_generate"]) for r in results
          if "hf_generate" in r.hf_tokens]
    out["hf_generate_token_agreement"] = float(np.mean(hf)) if hf else None
    return out


def by_category(results: Sequence[PromptResult], greedy: bool, k_alpha: int) -> dict:
    groups: dict[str, list[PromptResult]] = {}
    for r in results:
        groups.setdefault(r.prompt.category, []).append(r)
    return {name: summarize(group, greedy, k_alpha) for name, group in sorted(groups.items())}


def per_prompt_rows(results: Sequence[PromptResult], greedy: bool) -> list[dict]:
    rows = []
    for r in results:
        plain, spec = r.stats["plain"], r.stats["spec"]
        rows.append({
            "line": r.prompt.line,
            "category": r.prompt.category,
            "prompt_tokens": r.prompt_tokens,
            "baseline_tokens": len(plain.tokens),
            "spec_tokens": len(spec.tokens),
            "tau": 1 + spec.accepted_tokens / spec.drafts if spec.drafts else None,
            "lossless": spec.tokens == plain.tokens and r.stats["chain"].tokens == plain.tokens if greedy else None,
            "spec_finish_reason": spec.finish_reason,
            "baseline_tokens_per_s": len(plain.tokens) / r.wall_s["plain"] if r.wall_s["plain"] > 0 else None,
            "spec_tokens_per_s": len(spec.tokens) / r.wall_s["spec"] if r.wall_s["spec"] > 0 else None,
        })
    return rows


# ---- running ----------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


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
            out, wall = _timed(lambda: generate(input_ids), self.device)
            result.wall_s[name] = wall
            if isinstance(out, list):
                result.hf_tokens[name] = out
            else:
                result.stats[name] = out
        result.stats.setdefault("chain", result.stats["spec"])
        return result


def alpha_chain_length(recipe) -> int:
    bench: BenchConfig = recipe.bench
    return (bench.alpha_chain_length or recipe.export.num_speculative_tokens
            or bench.decoder.num_speculative_tokens)


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


def load_bench_inputs(recipe, head_dir: Path):
    """(target, tokenizer, head): the head is refused if it was trained for another tokenizer or vocabulary."""
    model, tokenizer = load_target(recipe.target)
    head, _ = load_head(head_dir, device=model.device, dtype=model.dtype, tokenizer=tokenizer,
                        target_vocab_size=text_config(model.config).vocab_size)
    return model, tokenizer, head.eval().requires_grad_(False)


def tune_decoder(model, head, tokenizer, cfg: DecoderConfig, all_prompts: Sequence[BenchPrompt],
                 chosen: Sequence[BenchPrompt], count: int) -> tuple[DecoderConfig, dict]:
    """Pick the draft shape on prompts the bench does not measure, when the file has any (else on measured
    ones, and the report says so), so the speedup is not selected on its own test set."""
    from eyas.eval.decoder import autotune

    measured = {p.line for p in chosen}
    held_out = [p for p in all_prompts if p.line not in measured][:count]
    tune_on = held_out or list(chosen[:count])
    ids = [encode_prompt(tokenizer, p, model.device) for p in tune_on]
    tuned, table = autotune(model, head, tokenizer, ids, cfg, max_new_tokens=min(cfg.max_new_tokens, 64))
    return tuned, {"table": table, "prompt_lines": [p.line for p in tune_on], "held_out": bool(held_out)}


def bench_input_hash(recipe, head_dir: Path, prompts_path: Path) -> str:
    """What a report depends on: target and bench settings, the exported K, the head's and prompts' content."""
    blob = json.dumps({"sections": recipe.section_hash("target", "bench"), "k": alpha_chain_length(recipe),
                       "head": head_content_hash(head_dir), "prompts": sha256_file(prompts_path)})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_bench(recipe, head_dir=None, prompts=None) -> Path:
    """Benchmark the head against plain decoding of its target; writes bench/report.json, summary.md, plots.

    Skipped (the existing report returned) when bench/DONE.json records the same inputs; delete it to re-measure.
    """
    from tqdm.auto import tqdm

    from eyas.eval.report import print_summary, write_json_atomic, write_plots, write_summary

    bench: BenchConfig = recipe.bench
    out_dir = recipe.stage_dir("bench")
    head_dir = Path(head_dir) if head_dir else recipe.stage_dir("head") / "best"
    prompts_path = Path(prompts or bench.prompts or recipe.stage_dir("data") / "prompts.jsonl")
    all_prompts = read_prompts(prompts_path)  # a bad prompts file fails before the target loads
    input_hash = bench_input_hash(recipe, head_dir, prompts_path) if (head_dir / WEIGHTS).exists() else None
    done = read_done(out_dir)
    if input_hash and done and done.get("input_hash") == input_hash and (out_dir / "report.json").exists():
        print(f"[bench] {out_dir / 'report.json'} is up to date ({DONE} matches); delete {out_dir / DONE} "
              "to measure again")
        return out_dir / "report.json"
    model, tokenizer, head = load_bench_inputs(recipe, head_dir)
    kernel_table = []
    if bench.linear_kernels == "auto":
        from eyas.data.linear_kernels import format_kernel_table, tune_linear_kernels

        kernel_table = tune_linear_kernels(model, head)
        if kernel_table:
            print("[bench] linear layout per row count (target + head, one pass over all layers):\n"
                  + format_kernel_table(kernel_table), flush=True)
    chosen = select_prompts(all_prompts, bench.num_prompts)
    device = model.device
    encoded = [encode_prompt(tokenizer, p, device) for p in chosen]
    warmup_ids = [encode_prompt(tokenizer, p, device) for p in all_prompts[:bench.warmup]]

    cfg = bench.decoder
    tune_table = None
    if bench.autotune:
        cfg, tune_table = tune_decoder(model, head, tokenizer, cfg, all_prompts, chosen, max(bench.warmup, 2))
    k_alpha = alpha_chain_length(recipe)
    runners = build_runners(model, head, tokenizer, cfg, bench, k_alpha)

    with torch.inference_mode():
        # Short warm-up runs reach the same kernels and caches as the measured ones.
        from eyas.eval.decoder import WARMUP_TOKENS

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

    greedy = cfg.temperature == 0
    report = summarize(results, greedy, k_alpha)
    exact_expected = greedy and model.dtype == torch.float32
    report.update({
        "lossless_exact_expected": exact_expected,
        "lossless_note": report.get("lossless_note") or (
            "fp32 greedy: speculative output must equal plain output exactly" if exact_expected else
            f"{str(model.dtype).removeprefix('torch.')}: a multi-token verify forward rounds differently from "
            "one-token decoding, so a divergence can be kernel numerics; see token_agreement"),
        "by_category": by_category(results, greedy, k_alpha),
        "per_prompt": per_prompt_rows(results, greedy),
        "decoder": dataclasses.asdict(cfg),
        "alpha_chain_length": k_alpha,
        "autotune": tune_table,
        "bench": {k: v for k, v in dataclasses.asdict(bench).items() if k != "decoder"},
        "head": {"path": str(Path(head_dir).resolve()), "sha256": head_content_hash(head_dir)},
        "target": {"name": recipe.target.name_or_path, "sha256": target_hash(recipe.target.name_or_path),
                   "tokenizer_sha256": tokenizer_hash(tokenizer)},
        "prompts_file": str(Path(prompts_path).resolve()),
        "environment": {"device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "linear_kernels": kernel_table,
                        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "created_unix": time.time(),
    })
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / DONE).unlink(missing_ok=True)  # the outputs change from here on
    report = plain_json(report)
    plots = write_plots(report, out_dir)
    report["plots"] = [p.name for p in plots]
    write_summary(report, out_dir / "summary.md")
    path = write_json_atomic(out_dir / "report.json", report)
    write_done(out_dir, input_hash, stage="bench", head_sha256=report["head"]["sha256"])  # written last
    print_summary(report)
    return path


def plain_json(value):
    """Plain JSON values: numpy and torch scalars unwrapped, NaN/inf as null (JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_json(dataclasses.asdict(value))
    if isinstance(value, torch.Tensor):
        return plain_json(value.tolist())
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
