"""The server's admission gate: 429 before routing while the queue is full, or while
the engine's last quote already puts the key's tenant past the TTFT objective, for
authenticated generation requests only."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ember.engine.forecast import Quote
from ember.server.app import AdmissionGate, Server
from ember.server.config import ServerConfig

KEY = "sk-gate-test"


class _Thread:
    def __init__(self, full: bool, quote: Quote | None = None) -> None:
        self.full, self._quote = full, quote

    def queue_full(self) -> bool:
        return self.full

    def quoted(self) -> tuple[Quote | None, dict]:
        return self._quote, {}


def _call(gate: AdmissionGate, path: str, method: str = "POST",
          auth: str | None = None, body: bytes = b"") -> tuple[list[dict[str, Any]], bool]:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if auth is not None:
        headers.append((b"authorization", auth.encode()))
    scope = {"type": "http", "path": path, "method": method, "headers": headers}
    sent: list[dict[str, Any]] = []
    reached = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        assert (await receive())["body"] == body  # the route reads the body the gate read

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


# 1,000 prompt tokens queued by each of two tenants, 100 per 0.1 s step: another tenant's
# request waits for its fair share of them
BACKLOG = Quote({(0, "tenant"): 1000, (0, "other"): 1000}, per_step=100, full_step=0.1,
                empty_step=0.02)
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture
def slo_server() -> Server:
    s = Server(ServerConfig(api_keys={KEY: "tenant"}, slo_ttft=1.0))
    s.thread = _Thread(full=False, quote=BACKLOG)  # type: ignore[assignment]
    return s


def test_a_queue_past_the_ttft_objective_refuses_before_routing(slo_server):
    """The tenant's 1,000 queued tokens and its fair share of the other's: 2 s ahead
    of any request of its own, against a 1 s objective."""
    assert BACKLOG.ttft("tenant") == pytest.approx(2.0)
    sent, reached = _call(AdmissionGate(None, slo_server), "/v1/chat/completions",
                          auth=f"Bearer {KEY}", body=CHAT)
    assert not reached
    start, body = sent
    assert start["status"] == 429
    assert dict(start["headers"])[b"retry-after"] == b"2"  # ceil(2.0 - 0.9 s)
    assert json.loads(body["body"])["error"]["code"] == "slo_unattainable"


def test_the_quote_counts_what_the_engine_computed_since_it_was_made():
    """The engine goes on stepping after a quote: half a second later, 500 of the 2,000
    tokens ahead are done; long after, only the request's own prompt is left."""
    quote = Quote(BACKLOG.queued, per_step=100, full_step=0.1, empty_step=0.02, at=100.0)
    assert quote.ttft("tenant", now=100.0) == pytest.approx(2.0)
    assert quote.ttft("tenant", now=100.5) == pytest.approx(1.5)
    assert quote.ttft("tenant", own=100, now=150.0) == pytest.approx(0.1)


def test_the_engines_progress_counts_only_against_the_queue_the_quote_held():
    """Nothing is credited against requests admitted after the quote (an idle engine
    computed none of them), and progress on another tenant's long backlog leaves a
    newcomer its fair-share round of what remains."""
    idle = Quote({}, per_step=100, full_step=0.1, empty_step=0.02, at=100.0)
    assert idle.ttft("tenant", on_the_way={(0, "tenant"): 1000}, now=100.5) \
        == pytest.approx(1.0)
    busy = Quote({(0, "other"): 10_000}, per_step=100, full_step=0.1, empty_step=0.02,
                  at=100.0)
    assert busy.ttft("tenant", own=2000, now=101.0) == pytest.approx(4.0)  # 2000 + 2000


@pytest.mark.parametrize("body", [
    json.dumps({"model": "m", "messages": [], "priority": -5}).encode(),  # may jump the queue
    json.dumps({"model": "m", "messages": [], "slo": {"ttft_ms": 9000}}).encode(),
], ids=["own-priority", "own-slo"])
def test_what_the_gate_cannot_price_goes_to_the_exact_check(slo_server, body):
    sent, reached = _call(AdmissionGate(None, slo_server), "/v1/chat/completions",
                          auth=f"Bearer {KEY}", body=body)
    assert reached and not sent


def test_a_queue_within_the_objective_passes_with_its_body(slo_server):
    slo_server.thread = _Thread(full=False, quote=Quote({}, 100, 0.1, 0.02))
    sent, reached = _call(AdmissionGate(None, slo_server), "/v1/chat/completions",
                          auth=f"Bearer {KEY}", body=CHAT)
    assert reached and not sent
