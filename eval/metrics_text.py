"""Serving engines' Prometheus /metrics: fetch, parse, and read the speculative-decoding figures.

The one place that knows the metric names (docs/engine.md lists them):
  vLLM counters   vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
                  _num_accepted_tokens_per_pos{position="i"}  (exposed with a `_total` suffix)
  SGLang gauges   sglang:spec_accept_length (tau), sglang:spec_accept_rate (accepted / proposed drafts),
                  sglang:spec_num_steps (the chain length, newer versions)
Counters are summed over label sets (one per engine core); gauges are averaged (one per rank).
"""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

VLLM_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
VLLM_GENERATION = "vllm:generation_tokens"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"
SGLANG_NUM_STEPS = "sglang:spec_num_steps"


class MetricsError(RuntimeError):
    """The metrics endpoint cannot be read or has no speculative figures; the message is one line."""


class CounterReset(MetricsError):
    """A counter went down between two reads: the server restarted in between."""


# ---- text format -----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _float(text: str) -> float:
    return {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(text) or float(text)


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}; comments skipped.

    A line that is not a sample raises ValueError naming the line, so a non-metrics page (an HTML
    error page, a proxy's answer) is never read as zero counters.
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"line {n} is not a Prometheus sample: {line[:80]!r}")
        labels: dict[str, str] = {}
        body = m.group(3) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if not lm:
                raise ValueError(f"line {n}: bad labels {body[:80]!r}")
            labels[lm.group(1)] = _unescape(lm.group(2))
            pos = lm.end()
        try:
            value = _float(m.group(4))
        except ValueError:
            raise ValueError(f"line {n}: value {m.group(4)!r} is not a number") from None
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def fetch_metrics_text(url: str, timeout_s: float = 10.0) -> str:
    """GET the /metrics text of a server given its base URL (or the /metrics URL itself)."""
    target = metrics_url(url)
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise MetricsError(f"{target} answered HTTP {exc.code} ({exc.reason}); is this a vLLM or SGLang "
                           "server with metrics enabled?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MetricsError(f"cannot reach {target}: {reason}") from None


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/metrics") else url + "/metrics"


def _counter(samples: dict, name: str) -> list[tuple[dict[str, str], float]] | None:
    # prometheus_client exposes a counter `x` as `x_total` (and a `x_created` timestamp, ignored)
    return samples.get(name + "_total", samples.get(name))


# ---- speculative figures ---------------------------------------------------------------------------

@dataclass
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters (summed over engines)."""
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    generation_tokens: float = 0.0

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos), "generation_tokens": self.generation_tokens}


def vllm_counters(samples: dict) -> SpecCounters | None:
    """The counters from parsed vLLM metrics; None when the server exposes no speculative metrics."""
    if _counter(samples, "vllm:spec_decode_num_drafts") is None:
        return None
    c = SpecCounters()
    for name, attr in VLLM_COUNTERS.items():
        setattr(c, attr, sum(v for _, v in _counter(samples, name) or []))
    per_pos: dict[int, float] = {}
    for labels, value in _counter(samples, VLLM_PER_POS) or []:
        i = int(labels.get("position", 0))
        per_pos[i] = per_pos.get(i, 0.0) + value
    c.accepted_per_pos = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    c.generation_tokens = sum(v for _, v in _counter(samples, VLLM_GENERATION) or [])
    return c


def counter_delta(before: SpecCounters, after: SpecCounters) -> SpecCounters:
    """after - before; CounterReset when any counter went down (the server restarted between reads)."""
    pairs = [("drafts", before.drafts, after.drafts), ("draft_tokens", before.draft_tokens, after.draft_tokens),
             ("accepted_tokens", before.accepted_tokens, after.accepted_tokens),
             ("generation_tokens", before.generation_tokens, after.generation_tokens)]
    n = max(len(before.accepted_per_pos), len(after.accepted_per_pos))
    b_pos = before.accepted_per_pos + [0.0] * (n - len(before.accepted_per_pos))
    a_pos = after.accepted_per_pos + [0.0] * (n - len(after.accepted_per_pos))
    pairs += [(f"accepted_per_pos[{i}]", b, a) for i, (b, a) in enumerate(zip(b_pos, a_pos))]
    for name, b, a in pairs:
        if a < b:
            raise CounterReset(f"counter {name} went down ({b:g} -> {a:g}): the server restarted")
    return SpecCounters(after.drafts - before.drafts, after.draft_tokens - before.draft_tokens,
                        after.accepted_tokens - before.accepted_tokens, [a - b for b, a in zip(b_pos, a_pos)],
                        after.generation_tokens - before.generation_tokens)


def read_metrics(url: str, timeout_s: float = 10.0) -> SpecCounters | None:
    """vLLM's cumulative speculative counters at `url` (base URL); None when speculation is off."""
    return vllm_counters(parse_metrics(fetch_metrics_text(url, timeout_s)))


def metrics_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters | None:
    """Counters accumulated between two reads (CounterReset if the server restarted in between)."""
    if before is None or after is None:
        return None
    return counter_delta(before, after)


def spec_figures(c: SpecCounters) -> dict:
    """Acceptance from (delta) counters, pooled over requests as the engine reports it.

    acceptance_rate = accepted / draft tokens; mean_acceptance_length tau = 1 + accepted / drafts;
    per_position[i] = accepted at position i / drafts. None where nothing was drafted.
    """
    drafts, tokens = c.drafts, c.draft_tokens
    return {
        "drafts": int(drafts), "draft_tokens": int(tokens), "accepted_tokens": int(c.accepted_tokens),
        "acceptance_rate": c.accepted_tokens / tokens if tokens else None,
        "mean_acceptance_length": 1 + c.accepted_tokens / drafts if drafts else None,
        "per_position": [a / drafts for a in c.accepted_per_pos] if drafts else None,
    }


def sglang_gauges(samples: dict) -> dict | None:
    """SGLang's acceptance gauges averaged over ranks; None when it exposes neither.

    Without spec_accept_rate (older versions) the rate follows from tau and the chain length that newer
    versions expose as spec_num_steps: rate = (tau - 1) / steps.
    """
    out = {}
    for key, name in (("mean_acceptance_length", SGLANG_ACCEPT_LENGTH), ("acceptance_rate", SGLANG_ACCEPT_RATE),
                      ("num_steps", SGLANG_NUM_STEPS)):
        values = [v for _, v in samples.get(name, []) if not math.isnan(v)]
        if values:
            out[key] = sum(values) / len(values)
    if "acceptance_rate" not in out and out.get("num_steps") and "mean_acceptance_length" in out:
        out["acceptance_rate"] = (out["mean_acceptance_length"] - 1) / out["num_steps"]
    out.pop("num_steps", None)
    return out or None


def detect_engine(samples: dict) -> str | None:
    """'vllm' or 'sglang' from the metric names present, None when neither."""
    if any(name.startswith("vllm:") for name in samples):
        return "vllm"
    if any(name.startswith("sglang:") for name in samples):
        return "sglang"
    return None
