"""Start and talk to real ``ember serve`` processes on free local ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
    proc: subprocess.Popen
    url: str
    log_path: Path
    model_id: str = ""
    metrics_key: str | None = None  # bearer key /metrics wants (an API key, or its own)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = READY_TIMEOUT, api_key: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.proc.returncode}:\n{self.log()}")
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
