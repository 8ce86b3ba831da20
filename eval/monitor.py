"""`eyas monitor URL`: a running vLLM or SGLang server's speculative acceptance, window by window.

Every `window_s` seconds one line: the window's acceptance rate (vLLM: accepted / draft tokens from the
counters' deltas, with the mean acceptance length and the per-position rates; SGLang: its
spec_accept_rate / spec_accept_length gauges averaged over the window's polls) and what to do about it.
The decision rule, relative to the bar b (the gate's minimum acceptance rate; docs/engine.md):

    rate <  b          disable       speculation costs more than it saves at this acceptance
    b <= rate < b+0.10 shorten K     marginal: the last draft positions are rarely accepted
    b+0.10 <= rate < b+0.25  keep    healthy
    rate >= b+0.25     try longer K  most drafts are accepted whole; a longer chain may pay

Exit status: 1 after `alert_after` consecutive windows below the bar (for alerting), 2 when the server
cannot be read or exposes no speculative metrics, 0 when `max_windows` windows passed without an alert,
130 on Ctrl-C. A window with no drafts (an idle server), one in which a counter went down (a restart) and
one in which the server did not answer neither count nor break the streak; each prints one line.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import TextIO

from eyas.eval.metrics_text import (
    CounterReset,
    MetricsError,
    SpecCounters,
    counter_delta,
    detect_engine,
    fetch_metrics_text,
    parse_metrics,
    sglang_gauges,
    spec_figures,
    vllm_counters,
)

MARGINAL_BAND = 0.10  # b .. b+0.10: shorten K
HIGH_MARGIN = 0.25  # >= b+0.25: try a longer K


def decision(rate: float, bar: float) -> str:
    """The action for a window's acceptance rate against the bar (see the module docstring)."""
    if rate < bar:
        return "disable"
    if rate < bar + MARGINAL_BAND:
        return "shorten K"
    if rate < bar + HIGH_MARGIN:
        return "keep"
    return "try longer K"


@dataclass
class Snapshot:
    engine: str
    counters: SpecCounters | None = None  # vLLM
    gauges: dict | None = None  # SGLang


def read_snapshot(url: str, timeout_s: float = 10.0) -> Snapshot:
    """One read of /metrics; MetricsError (one line) when unreadable or without speculative metrics."""
    text = fetch_metrics_text(url, timeout_s)
    try:
        samples = parse_metrics(text)
    except ValueError as exc:
        raise MetricsError(f"{url}: the /metrics answer is not Prometheus text ({exc})") from None
    engine = detect_engine(samples)
    if engine == "vllm":
        counters = vllm_counters(samples)
        if counters is None:
            raise MetricsError(f"{url}: vLLM server without speculative-decoding metrics (no "
                               "vllm:spec_decode_num_drafts): is it serving with a speculative_config?")
        return Snapshot("vllm", counters=counters)
    if engine == "sglang":
        gauges = sglang_gauges(samples)
        if gauges is None:
            raise MetricsError(f"{url}: SGLang server without speculative metrics (no sglang:spec_accept_rate "
                               "or sglang:spec_accept_length): is it serving with --speculative-algorithm?")
        return Snapshot("sglang", gauges=gauges)
    raise MetricsError(f"{url}: /metrics has neither vllm: nor sglang: metrics; not a vLLM or SGLang server")


@dataclass
class Window:
    index: int
    engine: str
    status: str  # ok | idle | reset | unreachable
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position: list[float] | None = None
    drafts: int | None = None
    action: str | None = None
    below_streak: int = 0
    message: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def line(self, bar: float) -> str:
        head = f"window {self.index:>3} [{self.engine}]"
        if self.status != "ok":
            return f"{head} {self.status}: {self.message}"
        parts = [f"acceptance {self.acceptance_rate:.3f} (bar {bar:.2f})"]
        if self.mean_acceptance_length is not None:
            parts.append(f"tau {self.mean_acceptance_length:.2f}")
        if self.per_position:
            parts.append("per position " + "/".join(f"{p:.2f}" for p in self.per_position))
        if self.drafts is not None:
            parts.append(f"{self.drafts} drafts")
        streak = f" ({self.below_streak} below in a row)" if self.below_streak else ""
        return f"{head} {', '.join(parts)} -> {self.action}{streak}"


def _vllm_window(before: SpecCounters, after: SpecCounters) -> dict | None:
    fig = spec_figures(counter_delta(before, after))
    if not fig["drafts"]:
        return None
    return {"acceptance_rate": fig["acceptance_rate"], "mean_acceptance_length": fig["mean_acceptance_length"],
            "per_position": fig["per_position"], "drafts": fig["drafts"]}


def monitor(url: str, window_s: float = 60.0, alert_after: int = 3, bar: float = 0.55, json_lines: bool = False,
            max_windows: int | None = None, poll_s: float = 5.0, out: TextIO = sys.stdout,
            err: TextIO = sys.stderr) -> int:
    """Watch `url`'s /metrics; returns the exit status (module docstring). Runs until an alert, Ctrl-C
    (status 130), or `max_windows` windows (None: forever). SGLang's gauges are polled every `poll_s`
    inside a window."""
    try:
        return _watch(url, window_s, alert_after, bar, json_lines, max_windows, poll_s, out, err)
    except KeyboardInterrupt:
        return 130


def _watch(url: str, window_s: float, alert_after: int, bar: float, json_lines: bool, max_windows: int | None,
           poll_s: float, out: TextIO, err: TextIO) -> int:
    def emit(w: Window) -> None:
        print(w.to_json() if json_lines else w.line(bar), file=out, flush=True)

    try:
        first = read_snapshot(url)
    except MetricsError as exc:
        print(f"eyas monitor: {exc}", file=err, flush=True)
        return 2
    engine, base, streak, index = first.engine, first, 0, 0
    if not json_lines:
        print(f"eyas monitor: {engine} at {url}, windows of {window_s:g} s, bar {bar:.2f}, alert after "
              f"{alert_after} windows below", file=out, flush=True)
    while max_windows is None or index < max_windows:
        index += 1
        gauge_reads, failure = [], None
        deadline = time.monotonic() + window_s
        snap = None
        while True:  # SGLang's gauges hold the latest batch only: average the polls of the window
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())) if engine == "sglang" else window_s)
            try:
                snap = read_snapshot(url)
                failure = None
                if snap.gauges:
                    gauge_reads.append(snap.gauges)
            except MetricsError as exc:
                failure = str(exc)
            if engine != "sglang" or time.monotonic() >= deadline:
                break
        w = Window(index=index, engine=engine, status="ok", below_streak=streak)
        figures = None
        if failure is not None or snap is None:
            w.status, w.message = "unreachable", failure or "no read"
        elif engine == "vllm":
            try:
                figures = _vllm_window(base.counters, snap.counters)
            except CounterReset as exc:
                w.status, w.message = "reset", f"{exc}; counting again from here"
            base = snap
            if w.status == "ok" and figures is None:
                w.status, w.message = "idle", "no drafts in this window (no traffic)"
        else:
            rates = [g["acceptance_rate"] for g in gauge_reads if "acceptance_rate" in g]
            taus = [g["mean_acceptance_length"] for g in gauge_reads if "mean_acceptance_length" in g]
            if rates:
                figures = {"acceptance_rate": sum(rates) / len(rates),
                           "mean_acceptance_length": sum(taus) / len(taus) if taus else None}
            else:
                w.status, w.message = "idle", "no acceptance rate in this window (only tau, or no traffic)"
        if figures is not None:
            for key, value in figures.items():
                setattr(w, key, value)
            w.action = decision(w.acceptance_rate, bar)
            streak = streak + 1 if w.action == "disable" else 0
            w.below_streak = streak
        emit(w)
        if streak >= alert_after:
            print(f"eyas monitor: acceptance below the bar {bar:.2f} for {streak} windows in a row: "
                  "disable speculation or retrain the head", file=err, flush=True)
            return 1
    return 0
