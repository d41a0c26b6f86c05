"""Start and talk to real ``ember serve`` servers on free local ports: separate processes
(:func:`start_server`: where a signal, a process kill, Ray or the process's own log is
under test) or in this process (:func:`serve_in_process`: the same options, app and
uvicorn server on a thread and a real socket, on a model already loaded — no interpreter,
torch import or model load per server)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ember import kernels

KEY_A = "sk-tenant-a-0123456789"
# Only test_prefix_cache_is_isolated_per_tenant may use KEY_B: it checks that B's first
# request finds nothing cached.
KEY_B = "sk-tenant-b-9876543210"
READY_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmberServer:
    proc: subprocess.Popen | None  # None: served in this process (``serving``)
    url: str
    log_path: Path
    model_id: str = ""
    metrics_key: str | None = None  # bearer key /metrics wants (an API key, or its own)
    serving: Any = None  # ember.server.run.Serving, in this process
    thread: threading.Thread | None = None  # the one running ``serving``
    log_handler: logging.Handler | None = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = READY_TIMEOUT, api_key: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.proc.returncode}:\n{self.log()}")
            if self.thread is not None and not self.thread.is_alive():
                raise RuntimeError(f"the in-process server stopped:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"ember serve not healthy after {timeout}s:\n{self.log()}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.metrics_key = self.metrics_key or api_key
        r = httpx.get(f"{self.url}/v1/models", headers=headers, timeout=5)
        r.raise_for_status()
        self.model_id = r.json()["data"][0]["id"]

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{'name{labels}': value}`` (comments dropped)."""
        headers = {"Authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}
        r = httpx.get(f"{self.url}/metrics", headers=headers, timeout=5)
        r.raise_for_status()
        text = r.text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            self.serving.stop()
            assert self.thread is not None
            self.thread.join(timeout)
            if self.log_handler is not None:
                logging.getLogger("ember").removeHandler(self.log_handler)
                self.log_handler.close()
            return None if self.thread.is_alive() else 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def served_weights() -> str:
    """The weight format of the real-model server: q4 (the default) where its kernel
    builds. The e2e tests replay requests in other batch shapes (n>1 choices alone,
    cached vs computed) and compare logprobs, which q4 keeps to the bit and f32 only
    to near-ties: its BLAS GEMMs choose their blocking by the number of rows."""
    return "q4" if kernels.available() else "f32"


def start_server(model: Path | str, log_dir: Path, *args: str,
                 weights: str = "f32") -> EmberServer:
    """Launch ``ember serve`` (not yet waited for: call ``wait_ready``)."""
    port = free_port()
    log_path = log_dir / f"ember-serve-{port}.log"
    cmd = [sys.executable, "-m", "ember.cli", "serve", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--weights", weights,
           *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return EmberServer(proc, f"http://127.0.0.1:{port}", log_path)


def serve_in_process(model: Path | str, log_dir: Path, *args: str, weights: str = "f32",
                     loaded: Any = None) -> EmberServer:
    """``ember serve`` with these options, in this process on a free port (not yet
    waited for: call ``wait_ready``); ``loaded``: the model, already loaded (else it is
    loaded in the background, as the CLI does). Its log file gets the ``ember`` logger's
    lines (every in-process server's: they share the logger)."""
    from ember import cli
    from ember.server import backend
    from ember.server.run import Serving

    parsed = cli._build_parser().parse_args(
        ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
         "--threads", "1", "--weights", weights, *args])
    config = cli.server_config(parsed)
    serving = Serving(config, "127.0.0.1", 0, parsed.graceful_seconds,
                      start=lambda: backend.local(config.engine, loaded))
    port = serving.url.rsplit(":", 1)[1]
    log_path = log_dir / f"ember-serve-in-process-{port}.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ember_log = logging.getLogger("ember")
    ember_log.addHandler(handler)
    ember_log.setLevel(logging.INFO)
    thread = threading.Thread(target=serving.run, name=f"ember-serve-{port}", daemon=True)
    thread.start()
    return EmberServer(None, serving.url, log_path, serving=serving, thread=thread,
                       log_handler=handler)
