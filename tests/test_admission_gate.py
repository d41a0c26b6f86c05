"""The server's admission gate: 429 before routing while the queue is full, for
authenticated generation requests only."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ember.server.app import AdmissionGate, Server
from ember.server.config import ServerConfig

KEY = "sk-gate-test"


class _Thread:
    def __init__(self, full: bool) -> None:
        self.full = full

    def queue_full(self) -> bool:
        return self.full


def _call(gate: AdmissionGate, path: str, method: str = "POST",
          auth: str | None = None) -> tuple[list[dict[str, Any]], bool]:
    headers = [(b"content-type", b"application/json")]
    if auth is not None:
        headers.append((b"authorization", auth.encode()))
    scope = {"type": "http", "path": path, "method": method, "headers": headers}
    sent: list[dict[str, Any]] = []
    reached = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    gate.app = app
    asyncio.run(gate(scope, receive, send))
    return sent, bool(reached)


@pytest.fixture
def server() -> Server:
    s = Server(ServerConfig(api_keys={KEY: "tenant"}))
    s.thread = _Thread(full=True)  # type: ignore[assignment]
    return s


def test_a_full_queue_refuses_an_authenticated_generation_request_before_routing(server):
    sent, reached = _call(AdmissionGate(None, server), "/v1/chat/completions",
                          auth=f"Bearer {KEY}")
    assert not reached
    start, body = sent
    assert start["status"] == 429
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert json.loads(body["body"])["error"]["code"] == "queue_full"
    assert server.metrics.rejected_429 == 1


@pytest.mark.parametrize("path,method,auth", [
    ("/v1/chat/completions", "POST", None),  # no key: the route answers 401
    ("/v1/chat/completions", "POST", "Bearer sk-wrong"),
    ("/v1/completions", "GET", f"Bearer {KEY}"),  # not a generation call
    ("/health", "GET", None),
    ("/metrics", "GET", f"Bearer {KEY}"),
])
def test_everything_else_passes_through(server, path, method, auth):
    sent, reached = _call(AdmissionGate(None, server), path, method, auth)
    assert reached and not sent


def test_a_queue_with_room_passes_through(server):
    server.thread = _Thread(full=False)  # type: ignore[assignment]
    sent, reached = _call(AdmissionGate(None, server), "/v1/responses", auth=f"Bearer {KEY}")
    assert reached and not sent
