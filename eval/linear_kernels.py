"""Small-batch matmul layout for linear layers on the CPU, chosen by measurement.

On the CPU, `F.linear(x, W)` with a few rows (2 to ~64: a speculative verify forward, batched
generation) takes a slow MKL path: verifying 4 tokens of SmolLM2-135M costs about 1.7 one-token
steps, although the step is bound by reading the weights, which a few more rows hardly change.
`(W @ x.T).T` computes the same product through another MKL kernel that is up to 2.7x faster at
those row counts, and no faster at 1 row or at training-size batches. Which layout wins depends on
the machine, so `tune_linear_kernels` times both on the model's own weights for each row count and
installs the faster one per row count; everything else keeps `F.linear`.

The plain decoder runs through the same installed layers, so speed ratios still compare the same
model with itself. On CUDA nothing is installed (cuBLAS has no such cliff).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def mm_layout(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight.T as (weight @ x.T).T, contiguous as F.linear's output is (callers .view() it)."""
    return torch.mm(weight, x.t()).t().contiguous()


class SmallBatchLinear(nn.Linear):
    """nn.Linear that computes (W @ x.T).T for the row counts in `mm_rows` (same result, other kernel)."""

    mm_rows: frozenset = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows not in self.mm_rows:
            return F.linear(x, self.weight, self.bias)
        y = mm_layout(self.weight, x.reshape(rows, x.shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def linear_modules(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def _time_layout(layers: list[nn.Linear], rows: int, use_mm: bool) -> float:
    """Seconds for one pass of `rows` rows through every layer (inputs made once per input width)."""
    p = layers[0].weight
    inputs = {w: torch.randn(rows, w, dtype=p.dtype, device=p.device) for w in {m.in_features for m in layers}}
    start = time.perf_counter()
    for m in layers:
        x = inputs[m.in_features]
        mm_layout(m.weight, x) if use_mm else F.linear(x, m.weight, m.bias)
    return time.perf_counter() - start


CURVE_FACTOR = 2.0  # a time above this many times another of the same point, or of more rows, is noise


def _suspicious(times: dict, row_counts) -> list[int]:
    """Row counts whose timings cannot be right: a median above CURVE_FACTOR times the fastest repeat (half
    the repeats were slowed down), or above CURVE_FACTOR times the same layout's median at a larger row
    count (more rows never cost much less)."""
    medians = {k: statistics.median(v) for k, v in times.items()}
    bad = []
    for i, r in enumerate(row_counts):
        for mm in (False, True):
            samples, later = times[(r, mm)], [medians[(s, mm)] for s in row_counts[i + 1:]]
            median = medians[(r, mm)]
            if median > CURVE_FACTOR * min(samples) or (later and median > CURVE_FACTOR * min(later)):
                bad.append(r)
                break
    return bad


def tune_linear_kernels(*models: nn.Module, row_counts=ROW_COUNTS, repeats: int = 3) -> list[dict]:
    """Time both layouts over all linear layers of `models` per row count, install the faster one per
    row count (a row count between two measured ones follows the smaller), and return the table.

    A loaded machine makes some timings wrong: row counts whose times cannot be right (see `_suspicious`)
    are timed again, twice as often; where they still are, the stock F.linear stays and a warning says so."""
    layers = [m for model in models for m in linear_modules(model)]
    if not layers or layers[0].weight.device.type != "cpu":
        return []
    times = {(r, mm): [] for r in row_counts for mm in (False, True)}

    def measure(rows, n):
        for _ in range(n):  # interleaved, so drift in machine load hits both layouts alike
            for r in rows:
                for mm in (False, True):
                    times[(r, mm)].append(_time_layout(layers, r, mm))

    measure(row_counts, repeats)
    remeasured = _suspicious(times, row_counts)
    for r in remeasured:
        times[(r, False)], times[(r, True)] = [], []
    measure(remeasured, 2 * repeats)
    inconsistent = set(_suspicious(times, row_counts)) & set(remeasured)
    table, mm_rows = [], set()
    for i, r in enumerate(row_counts):
        linear_s, mm_s = (statistics.median(times[(r, mm)]) for mm in (False, True))
        # a clear win only; ties, and timings that stayed inconsistent, keep the stock kernel
        use_mm = mm_s < 0.95 * linear_s and r not in inconsistent
        row = {"rows": r, "linear_ms": round(1e3 * linear_s, 2), "mm_ms": round(1e3 * mm_s, 2),
               "layout": "mm" if use_mm else "linear", "remeasured": r in remeasured,
               "consistent": r not in inconsistent}
        if r in inconsistent:
            row["note"] = "timings stayed inconsistent after re-measuring; kept F.linear"
            warnings.warn(f"matmul layout timings at {r} rows stay inconsistent after re-measuring (F.linear "
                          f"{row['linear_ms']} ms, (W@x.T).T {row['mm_ms']} ms): the machine is probably loaded; "
                          "kept F.linear there")
        table.append(row)
        if use_mm:
            upper = row_counts[i + 1] if i + 1 < len(row_counts) else r + 1
            mm_rows.update(range(r, upper))
    install_linear_kernels(models, frozenset(mm_rows))
    return table


def install_linear_kernels(models, mm_rows: frozenset) -> None:
    """Make every nn.Linear of `models` a SmallBatchLinear using the mm layout for `mm_rows`."""
    for model in models:
        for m in linear_modules(model):
            if type(m) in (nn.Linear, SmallBatchLinear):
                m.__class__ = SmallBatchLinear
                m.mm_rows = frozenset(mm_rows)


def remove_linear_kernels(*models: nn.Module) -> None:
    for model in models:
        for m in model.modules():
            if type(m) is SmallBatchLinear:
                m.__class__ = nn.Linear
                del m.mm_rows


def format_kernel_table(table: list[dict]) -> str:
    lines = ["rows  F.linear ms  (W@x.T).T ms  layout"]
    lines += [f"{t['rows']:>4}  {t['linear_ms']:>11.1f}  {t['mm_ms']:>12.1f}  {t['layout']}"
              + ("" if t["consistent"] else f"  ({t['note']})") for t in table]
    return "\n".join(lines)
