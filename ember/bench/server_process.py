"""A benchmark's server in its own process (llama-server, ``ember serve``, llama.cpp's
router): on a free port, ready once ``/health`` answers 200, stopped when the ``with``
ends. Its output goes to a temporary file; the last lines of it explain a failed start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``cmd`` listening on ``port``; ``group``: its own process group, stopped whole
    (a server that starts children, as llama.cpp's router does)."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str] | None = None,
                 wait_seconds: float = 60.0, group: bool = False) -> None:
        self.cmd, self.port, self.env = cmd, port, env
        self.wait_seconds, self.group = wait_seconds, group
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> str:
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=self.group)
        deadline = time.monotonic() + self.wait_seconds
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
        self.__exit__()
        raise RuntimeError(f"{os.path.basename(self.cmd[0])} did not start: "
                           f"{' '.join(self.cmd)}: " + " | ".join(tail))

    def __exit__(self, *exc: object) -> None:
        if self.group:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        else:
            self.proc.terminate()
        self.proc.wait(60)
        self.log.close()
