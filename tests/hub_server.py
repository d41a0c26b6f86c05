"""A local stand-in for the Hugging Face Hub's HTTP surface, for tests that must not reach
the internet: the model-info API (``/api/models/ORG/REPO[/revision/REV]`` with
``?blobs=true``: each file's size and LFS sha256) and the resolve route
(``/ORG/REPO/resolve/REV/PATH``: HEAD with ``X-Repo-Commit``, ``X-Linked-Etag`` and
``X-Linked-Size`` as the Hub sends them for LFS files, GET with ``Range``), the error
codes ``huggingface_hub`` reads (``X-Error-Code``: RepoNotFound, GatedRepo,
EntryNotFound, RevisionNotFound). Point ``HF_ENDPOINT`` at :attr:`HubServer.url`.

``rate``: bytes per second a file is served at (None: at once), so a test can kill a
download midway; every GET's first byte is recorded in ``ranges``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Path]] = {}  # repo -> {path in repo: file}
        self.gated: set[str] = set()
        self.rate: float | None = None
        self.ranges: list[tuple[str, int]] = []  # (file, first byte) of each GET
        self.tamper: dict[str, bytes] = {}  # path in repo -> bytes served instead
        self._digests: dict[Path, str] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo: str, files: dict[str, Path]) -> None:
        self.repos[repo] = files

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------ handling
    def _sha256(self, path: Path) -> str:
        if path not in self._digests:
            self._digests[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self._digests[path]

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str) -> None:
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        body = json.dumps({"error": code}).encode()
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        parts = unquote(urlparse(h.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            return self._info(h, parts[2:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        self._error(h, 404, "EntryNotFound")

    def _repo(self, h: BaseHTTPRequestHandler, repo: str) -> dict[str, Path] | None:
        if repo not in self.repos:
            self._error(h, 404, "RepoNotFound")
            return None
        if repo in self.gated and "authorization" not in {k.lower() for k in h.headers}:
            self._error(h, 401, "GatedRepo")
            return None
        return self.repos[repo]

    def _info(self, h: BaseHTTPRequestHandler, rest: list[str]) -> None:
        repo = "/".join(rest[:2])
        if len(rest) > 2 and rest[2:3] == ["revision"] and rest[3] not in ("main", COMMIT):
            return self._error(h, 404, "RevisionNotFound")
        files = self._repo(h, repo)
        if files is None:
            return
        siblings = [{"rfilename": name, "size": path.stat().st_size, "blobId": "0" * 40,
                     "lfs": {"size": path.stat().st_size, "sha256": self._sha256(path),
                             "pointerSize": 134}} for name, path in sorted(files.items())]
        data = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                           "gated": repo in self.gated, "siblings": siblings,
                           "tags": ["gguf"]}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _file(self, h: BaseHTTPRequestHandler, repo: str, revision: str, name: str,
              body: bool) -> None:
        files = self._repo(h, repo)
        if files is None:
            return
        if name not in files:
            return self._error(h, 404, "EntryNotFound")
        path = files[name]
        data = self.tamper.get(name) or path.read_bytes()
        start = 0
        if body and h.headers.get("Range", "").startswith("bytes="):
            start = int(h.headers["Range"][6:].split("-")[0])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("X-Linked-Etag", f'"{self._sha256(path)}"')
        h.send_header("X-Linked-Size", str(path.stat().st_size))
        h.send_header("ETag", f'"{self._sha256(path)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return
        self.ranges.append((name, start))
        chunk = 1 << 16
        try:
            for pos in range(start, len(data), chunk):
                h.wfile.write(data[pos:pos + chunk])
                if self.rate:
                    time.sleep(chunk / self.rate)
        except (BrokenPipeError, ConnectionResetError):
            pass
