"""Small-batch matmul layout for linear layers on the CPU, chosen by measurement.

On the CPU, `F.linear(x, W)` with a few rows (2 to ~64: a speculative verify forward, batched
generation) takes a slow MKL path: verifying 4 tokens of SmolLM2-135M costs about 1.7 one-token
steps, although the step is bound by reading the weights, which a few more rows hardly change.
`(W @ x.T).T` computes the same product through another MKL kernel that is up to 2.7x faster at
those row counts, and no faster at 1 row or at training-size batches. Which layout wins depends on
the machine, so `tune_linear_kernels` times both on the model's own weights for each row count and
installs the faster one per row count; everything else keeps `F.linear`.

One row is its own case: there MKL's matrix-vector product may run on one thread, so a one-token
decode step can cost about twice what the same step costs with two rows. `pad` computes the one row
as two (the row and a zero row, through the `(W @ x.T).T` kernel) and keeps the first; it is timed
like the others and installed only where it is faster. This is what makes plain decoding as fast as the
machine allows, so a speedup over it is honest.

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


def padded_layout(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One row [1, in] computed as two (with a zero row) through mm_layout; the first row of the result."""
    return mm_layout(weight, torch.cat([x, torch.zeros_like(x)]))[:1]


LAYOUTS = {"linear": lambda w, x: F.linear(x, w), "mm": mm_layout, "pad": padded_layout}


class SmallBatchLinear(nn.Linear):
    """nn.Linear that computes (W @ x.T).T for the row counts in `mm_rows`, and one row padded to two
    when `pad_one_row` (the same result through other kernels)."""

    mm_rows: frozenset = frozenset()
    pad_one_row: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 1 and self.pad_one_row:
            layout = padded_layout
        elif rows in self.mm_rows:
            layout = mm_layout
        else:
            return F.linear(x, self.weight, self.bias)
        y = layout(self.weight, x.reshape(rows, x.shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def linear_modules(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def _time_layout(layers: list[nn.Linear], rows: int, layout: str) -> float:
    """Seconds for one pass of `rows` rows through every layer (inputs made once per input width)."""
    p = layers[0].weight
    inputs = {w: torch.randn(rows, w, dtype=p.dtype, device=p.device) for w in {m.in_features for m in layers}}
    compute = LAYOUTS[layout]
    start = time.perf_counter()
    for m in layers:
        compute(m.weight, inputs[m.in_features])
    return time.perf_counter() - start


def _layouts(rows: int) -> tuple[str, ...]:
    return ("linear", "mm", "pad") if rows == 1 else ("linear", "mm")


CURVE_FACTOR = 2.0  # a time above this many times another of the same point, or of more rows, is noise


def _suspicious(times: dict, row_counts) -> list[int]:
    """Row counts whose timings cannot be right: a median above CURVE_FACTOR times the fastest repeat (half
    the repeats were slowed down), or above CURVE_FACTOR times the same layout's median at a larger row
    count (more rows never cost much less)."""
    medians = {k: statistics.median(v) for k, v in times.items()}
    bad = []
    for i, r in enumerate(row_counts):
        for layout in ("linear", "mm"):
            samples, later = times[(r, layout)], [medians[(s, layout)] for s in row_counts[i + 1:]]
            median = medians[(r, layout)]
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
    times = {(r, layout): [] for r in row_counts for layout in _layouts(r)}

    def measure(rows, n):
        for _ in range(n):  # interleaved, so drift in machine load hits every layout alike
            for r in rows:
                for layout in _layouts(r):
                    times[(r, layout)].append(_time_layout(layers, r, layout))

    measure(row_counts, repeats)
    remeasured = _suspicious(times, row_counts)
    for r in remeasured:
        for layout in _layouts(r):
            times[(r, layout)] = []
    measure(remeasured, 2 * repeats)
    inconsistent = set(_suspicious(times, row_counts)) & set(remeasured)
    table, mm_rows, pad_one_row = [], set(), False
    for i, r in enumerate(row_counts):
        medians = {layout: statistics.median(times[(r, layout)]) for layout in _layouts(r)}
        # a clear win only (5%); ties, and timings that stayed inconsistent, keep the stock kernel
        best = min(medians, key=medians.get)
        if r in inconsistent or medians[best] >= 0.95 * medians["linear"]:
            best = "linear"
        row = {"rows": r, **{f"{layout}_ms": round(1e3 * t, 2) for layout, t in medians.items()},
               "layout": best, "remeasured": r in remeasured, "consistent": r not in inconsistent}
        if r in inconsistent:
            row["note"] = "timings stayed inconsistent after re-measuring; kept F.linear"
            warnings.warn(f"matmul layout timings at {r} rows stay inconsistent after re-measuring (F.linear "
                          f"{row['linear_ms']} ms, (W@x.T).T {row['mm_ms']} ms): the machine is probably loaded; "
                          "kept F.linear there")
        table.append(row)
        if best == "pad":
            pad_one_row = True
        elif best == "mm":
            upper = row_counts[i + 1] if i + 1 < len(row_counts) else r + 1
            mm_rows.update(range(r, upper))
    install_linear_kernels(models, frozenset(mm_rows), pad_one_row)
    return table


def install_linear_kernels(models, mm_rows: frozenset, pad_one_row: bool = False) -> None:
    """Make every nn.Linear of `models` a SmallBatchLinear using the mm layout for `mm_rows` (and, with
    `pad_one_row`, one row computed as two)."""
    for model in models:
        for m in linear_modules(model):
            if type(m) in (nn.Linear, SmallBatchLinear):
                m.__class__ = SmallBatchLinear
                m.mm_rows = frozenset(mm_rows)
                m.pad_one_row = pad_one_row


def remove_linear_kernels(*models: nn.Module) -> None:
    for model in models:
        for m in model.modules():
            if type(m) is SmallBatchLinear:
                m.__class__ = nn.Linear
                del m.mm_rows, m.pad_one_row


def format_kernel_table(table: list[dict]) -> str:
    lines = ["rows  F.linear ms  (W@x.T).T ms  padded to 2 ms  layout"]
    lines += [f"{t['rows']:>4}  {t['linear_ms']:>11.1f}  {t['mm_ms']:>12.1f}  "
              + (f"{t['pad_ms']:>14.1f}" if "pad_ms" in t else f"{'-':>14}") + f"  {t['layout']}"
              + ("" if t["consistent"] else f"  ({t['note']})") for t in table]
    return "\n".join(lines)
