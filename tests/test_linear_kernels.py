"""The small-batch matmul layout: same numbers as F.linear, installed per row count, lossless decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_target
from eyas.eval.linear_kernels import (ROW_COUNTS, SmallBatchLinear, install_linear_kernels, remove_linear_kernels,
                                      tune_linear_kernels)
from eyas.eval.config import DecoderConfig
from eyas.eval.decoder import PlainDecoder, SpeculativeDecoder
from test_decoder_lossless import VOCAB, fit_head, greedy_sequences, new_head, random_prompts, tokenizer  # noqa: F401


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 7), (1, 1, 7)])
def test_mm_layout_matches_f_linear(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(7, 5, bias=bias)
    x = torch.randn(*shape)
    want = F.linear(x, layer.weight, layer.bias)
    rows = x.numel() // 7
    install_linear_kernels([layer], frozenset({rows}))
    assert type(layer) is SmallBatchLinear
    got = layer(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The layout really switched: a row count outside the set takes F.linear, inside it torch.mm.
    calls = []
    real_mm = torch.mm
    try:
        torch.mm = lambda *a: calls.append(1) or real_mm(*a)
        layer(x)
        layer(torch.randn(rows + 1, 7))
    finally:
        torch.mm = real_mm
    assert calls == [1]


def test_tune_installs_on_every_linear_and_remove_restores():
    model = tiny_target("llama", VOCAB)
    ids = torch.randint(3, VOCAB, (1, 4))
    want = model(ids).logits
    table = tune_linear_kernels(model, row_counts=(1, 4, 8), repeats=1)
    assert [row["rows"] for row in table] == [1, 4, 8]
    assert all(row["layout"] in ("mm", "linear", "pad") and row["linear_ms"] > 0 and row["mm_ms"] > 0 for row in table)
    assert table[0]["pad_ms"] > 0 and all("pad_ms" not in row for row in table[1:])  # padding is for one row only
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is SmallBatchLinear for m in linears)
    chosen = {r for row, upper in zip(table, [4, 8, 9]) if row["layout"] == "mm" for r in range(row["rows"], upper)}
    assert linears[0].mm_rows == chosen and linears[0].pad_one_row == (table[0]["layout"] == "pad")
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    remove_linear_kernels(model)
    assert all(type(m) is nn.Linear and not hasattr(m, "mm_rows") for m in linears)


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_padded_to_two_matches_f_linear(bias):
    torch.manual_seed(0)
    layer = nn.Linear(7, 5, bias=bias)
    for shape in [(7,), (1, 7), (1, 1, 7)]:
        x = torch.randn(*shape)
        want = F.linear(x, layer.weight, layer.bias)
        install_linear_kernels([layer], frozenset(), pad_one_row=True)
        calls = []
        real_cat = torch.cat
        try:
            torch.cat = lambda t, *a, **k: calls.append(len(t)) or real_cat(t, *a, **k)
            got = layer(x)
            layer(torch.randn(2, 7))  # two rows are not padded
        finally:
            torch.cat = real_cat
        assert calls == [2]  # the one row really went through the padded kernel
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_padding_is_installed_only_where_it_wins(monkeypatch):
    import eyas.eval.linear_kernels as lk

    # One row through F.linear runs on one thread (0.011 s); two rows, either kernel, cost 0.006 s.
    timings = {"linear": lambda r: 0.011 if r == 1 else 0.010 + 0.001 * r, "mm": MM_CURVE,
               "pad": lambda r: 0.006}
    monkeypatch.setattr(lk, "_time_layout", lambda layers, rows, layout: timings[layout](rows))
    layer = nn.Linear(4, 4)
    table = tune_linear_kernels(layer, row_counts=(1, 2, 4), repeats=1)
    assert table[0]["layout"] == "pad" and layer.pad_one_row and 1 not in layer.mm_rows
    timings["pad"] = lambda r: 0.0109  # not a clear win: the stock kernel stays
    table = tune_linear_kernels(layer, row_counts=(1, 2, 4), repeats=1)
    assert table[0]["layout"] == "linear" and not layer.pad_one_row


def test_nothing_is_installed_off_the_cpu():
    model = tiny_target("llama", VOCAB).to("meta")
    assert tune_linear_kernels(model, row_counts=(1,), repeats=1) == []
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert ROW_COUNTS[0] == 1


def test_greedy_decoding_stays_lossless_with_the_mm_layout(tokenizer):
    """Every verify width through torch.mm, one-row steps padded to two: the output is still the target's."""
    model = tiny_target("llama", VOCAB)
    prompts = random_prompts(2)
    head = new_head(model)
    fit_head(model, head, greedy_sequences(model, tokenizer, prompts, 24), steps=40, lr=3e-2)
    install_linear_kernels([model, head], frozenset(range(2, 65)), pad_one_row=True)
    cfg = DecoderConfig(mode="tree", depth=3, topk=2, budget=4, max_new_tokens=24)
    plain, spec = PlainDecoder(model, tokenizer, cfg), SpeculativeDecoder(model, head, tokenizer, cfg)
    accepted = 0
    for ids in prompts:
        want, got = plain.generate(ids), spec.generate(ids)
        assert got.tokens == want.tokens
        accepted += got.accepted_tokens
    assert accepted > 0


def fake_timer(curves, spikes=None):
    """A timing function: curves[layout](rows) seconds, except that spikes[(rows, layout)] yields its values
    first (a burst of load from another process), then the curve again."""
    pending = {k: list(v) for k, v in (spikes or {}).items()}
    calls = []

    def time_layout(layers, rows, layout):
        calls.append((rows, layout))
        queue = pending.get((rows, layout))
        return queue.pop(0) if queue else curves[layout](rows)
    return time_layout, calls


ROWS = (1, 2, 4, 8, 12, 16)
LINEAR = lambda r: 0.010 + 0.001 * r  # noqa: E731
MM_CURVE = lambda r: 0.0115 if r == 1 else 0.005 + 0.001 * r  # noqa: E731
PAD = lambda r: 0.012  # noqa: E731  (one row padded to two: no faster here)
MM = {"linear": LINEAR, "mm": MM_CURVE, "pad": PAD}


def test_a_burst_of_load_during_layout_timing_is_measured_again(monkeypatch):
    import eyas.eval.linear_kernels as lk

    # The whole first round at 12 rows, mm layout, was hit: 100 ms, more than 16 rows take.
    timer, calls = fake_timer(MM, spikes={(12, "mm"): [0.1, 0.1, 0.1]})
    monkeypatch.setattr(lk, "_time_layout", timer)
    table = tune_linear_kernels(nn.Linear(4, 4), row_counts=ROWS, repeats=3)
    row = {t["rows"]: t for t in table}
    assert row[12]["layout"] == "mm" and row[12]["remeasured"] is True and row[12]["consistent"] is True
    assert row[12]["mm_ms"] == pytest.approx(17.0)
    assert row[1]["layout"] == "linear" and all(row[r]["layout"] == "mm" for r in (2, 4, 8, 16))
    assert calls.count((12, "mm")) > 3 and calls.count((4, "mm")) == 3  # only the odd point was re-timed


def test_timings_that_stay_inconsistent_keep_the_stock_layout_and_warn(monkeypatch):
    import eyas.eval.linear_kernels as lk

    # At 12 rows F.linear always takes 60 ms (over twice what 16 rows take): whichever layout "wins" there is noise.
    linear = lambda r: 0.06 if r == 12 else LINEAR(r)  # noqa: E731
    timer, _ = fake_timer({**MM, "linear": linear})
    monkeypatch.setattr(lk, "_time_layout", timer)
    layer = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="12 rows.*inconsistent"):
        table = tune_linear_kernels(layer, row_counts=ROWS, repeats=3)
    row = {t["rows"]: t for t in table}
    assert row[12]["layout"] == "linear" and row[12]["consistent"] is False
    assert 12 not in layer.mm_rows and 8 in layer.mm_rows and 16 in layer.mm_rows
    assert 13 not in layer.mm_rows  # the rows between 12 and 16 follow 12
