"""`eyas monitor`: windows over recorded SGLang metric text and crafted vLLM counters served by a local
HTTP server, the failure lines, and (slow) a real vLLM server under load."""

from __future__ import annotations

import io
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eyas.data.engine import free_port
from eyas.eval.metrics_text import parse_metrics, sglang_gauges
from eyas.eval.monitor import HIGH_MARGIN, MARGINAL_BAND, decision, monitor

SGLANG_TEXT = (Path(__file__).parent / "data" / "sglang_metrics.txt").read_text()


@contextmanager
def metrics_server(texts: list[str]):
    """127.0.0.1 server answering /metrics with texts[0], texts[1], ... (the last one repeated)."""
    served = {"n": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = texts[min(served["n"], len(texts) - 1)].encode()
            served["n"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", served
    finally:
        httpd.shutdown()
        httpd.server_close()


def vllm_text(drafts: int, accepted_per_pos: list[int], k: int = 3) -> str:
    """vLLM's spec-decode counters as its server writes them (names, _total suffix, labels, _created)."""
    labels = 'engine="0",model_name="/models/target"'
    accepted = sum(accepted_per_pos)
    lines = ["# HELP vllm:generation_tokens_total Number of generation tokens processed.",
             "# TYPE vllm:generation_tokens_total counter",
             f"vllm:generation_tokens_total{{{labels}}} {float(drafts + accepted)}"]
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", k * drafts), ("num_accepted_tokens", accepted)):
        lines += [f"# TYPE vllm:spec_decode_{name}_total counter",
                  f"vllm:spec_decode_{name}_total{{{labels}}} {float(value)}",
                  f"vllm:spec_decode_{name}_created{{{labels}}} 1.7960940560043592e+09"]
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(v)}'
              for i, v in enumerate(accepted_per_pos)]
    return "\n".join(lines) + "\n"


def run(url, **kw):
    out, err = io.StringIO(), io.StringIO()
    kw.setdefault("window_s", 0.2)
    code = monitor(url, out=out, err=err, **kw)
    return code, out.getvalue().splitlines(), err.getvalue().splitlines()


def test_decision_bands_relative_to_the_bar():
    bar = 0.55
    assert decision(0.54, bar) == "disable"
    assert decision(0.55, bar) == decision(bar + MARGINAL_BAND - 0.01, bar) == "shorten K"
    assert decision(bar + MARGINAL_BAND, bar) == decision(bar + HIGH_MARGIN - 0.01, bar) == "keep"
    assert decision(bar + HIGH_MARGIN, bar) == decision(0.99, bar) == "try longer K"
    assert decision(0.2, 0.1) == "keep"  # a low (quickstart) bar moves every band with it


def test_recorded_sglang_text_parses():
    gauges = sglang_gauges(parse_metrics(SGLANG_TEXT))
    assert gauges == pytest.approx({"mean_acceptance_length": 2.35, "acceptance_rate": 0.45})
    # without spec_accept_rate the rate follows from tau and the chain length: (2.35 - 1) / 3
    older = "\n".join(line for line in SGLANG_TEXT.splitlines() if "spec_accept_rate" not in line)
    assert sglang_gauges(parse_metrics(older))["acceptance_rate"] == pytest.approx(0.45)


def test_sglang_below_the_bar_alerts_after_n_windows():
    with metrics_server([SGLANG_TEXT]) as (url, _):
        code, out, err = run(url, bar=0.55, alert_after=2, poll_s=0.05)
    assert code == 1
    windows = [line for line in out if line.startswith("window")]
    assert len(windows) == 2 and all("acceptance 0.450" in w and "-> disable" in w for w in windows)
    assert "[sglang]" in windows[0] and "tau 2.35" in windows[0]
    assert len(err) == 1 and "below the bar 0.55 for 2 windows" in err[0]


def test_sglang_healthy_json_lines():
    with metrics_server([SGLANG_TEXT]) as (url, _):
        code, out, err = run(url, bar=0.30, alert_after=2, max_windows=2, json_lines=True, poll_s=0.05)
    assert code == 0 and not err
    rows = [json.loads(line) for line in out]
    assert len(rows) == 2
    assert all(r["engine"] == "sglang" and r["action"] == "keep" and r["acceptance_rate"] == pytest.approx(0.45)
               for r in rows)


def test_vllm_windows_per_position_idle_and_reset():
    texts = [vllm_text(100, [60, 30, 15]),
             vllm_text(200, [140, 90, 50]),  # window 1: 100 drafts, accepted 80/60/35
             vllm_text(200, [140, 90, 50]),  # window 2: idle
             vllm_text(10, [5, 2, 1]),  # window 3: restarted, counters down
             vllm_text(110, [25, 12, 6])]  # window 4: 100 drafts, accepted 20/10/5
    with metrics_server(texts) as (url, served):
        code, out, err = run(url, bar=0.55, alert_after=5, max_windows=4, json_lines=True)
    assert code == 0 and not err and served["n"] == 5
    rows = [json.loads(line) for line in out]
    assert [r["status"] for r in rows] == ["ok", "idle", "reset", "ok"]
    assert rows[0]["per_position"] == pytest.approx([0.8, 0.6, 0.35]) and rows[0]["drafts"] == 100
    assert rows[0]["acceptance_rate"] == pytest.approx(175 / 300) and rows[0]["action"] == "shorten K"
    assert rows[0]["mean_acceptance_length"] == pytest.approx(2.75)
    assert "went down" in rows[2]["message"] and "restarted" in rows[2]["message"]
    assert rows[3]["acceptance_rate"] == pytest.approx(35 / 300) and rows[3]["action"] == "disable"
    assert rows[3]["below_streak"] == 1


def test_vllm_text_lines_name_position_and_action():
    texts = [vllm_text(0, [0, 0, 0]), vllm_text(100, [95, 90, 85])]
    with metrics_server(texts) as (url, _):
        code, out, _ = run(url, bar=0.55, max_windows=1)
    assert code == 0
    assert out[0].startswith("eyas monitor: vllm at")
    assert "per position 0.95/0.90/0.85" in out[1] and "-> try longer K" in out[1] and "100 drafts" in out[1]


def test_unreachable_url_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = run(url)
    assert code == 2 and not out and len(err) == 1 and "cannot reach" in err[0] and url in err[0]


def test_server_without_speculative_metrics_is_one_line():
    plain = "# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{engine=\"0\"} 12.0\n"
    with metrics_server([plain]) as (url, _):
        code, out, err = run(url)
    assert code == 2 and not out and len(err) == 1 and "without speculative-decoding metrics" in err[0]
    with metrics_server(["<html>not metrics</html>"]) as (url, _):
        code, _, err = run(url)
    assert code == 2 and len(err) == 1 and "not Prometheus text" in err[0]


@pytest.mark.slow
def test_real_vllm_server_under_load(tmp_path):
    """A random head served by vLLM under a stream of requests: windows count real drafts, and acceptance
    that low (random weights) is below the bar, so the monitor alerts."""
    from test_engine import PROMPTS, needs_vllm, random_head_export, smollm2_dir

    from eyas.data.engine import VllmServer
    from eyas.eval.engine_bench import request_body, stream_request

    if needs_vllm.args[0]:
        pytest.skip("vLLM is not installed")
    export = random_head_export(tmp_path)
    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": 3}
    with VllmServer(smollm2_dir(), tmp_path / "logs", speculative_config=spec) as server:
        model, stop = server.served_model(), threading.Event()

        def load():
            while not stop.is_set():
                stream_request(server.url, *request_body(PROMPTS[0], model, 16), 0, "chat")

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        try:
            code, out, err = run(server.url, window_s=4.0, bar=0.55, alert_after=2, json_lines=True)
        finally:
            stop.set()
            worker.join(timeout=60)
    rows = [json.loads(line) for line in out]
    assert code == 1 and len(err) == 1
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["engine"] == "vllm" and r["drafts"] > 0 and len(r["per_position"]) == 3 for r in ok)
    assert all(r["action"] == "disable" for r in ok)
