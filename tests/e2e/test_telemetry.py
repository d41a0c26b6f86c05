"""Traces and the request log, checked with a real OTLP/HTTP receiver: a small HTTP
server in this test that decodes each export with ``opentelemetry-proto``."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import _serve
from e2e_server import KEY_A, EmberServer
from test_server import sdk, user

from ember.server.metrics import tenant_hash

pytestmark = pytest.mark.slow
trace_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

SECRET = "the-password-is-swordfish"  # prompt text that must never be exported


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span it was sent."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                export = trace_pb2.ExportTraceServiceRequest.FromString(body)
                with owner.lock:
                    for rs in export.resource_spans:
                        for ss in rs.scope_spans:
                            owner.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: bytes, timeout: float = 15.0) -> list:
        """The spans of one trace, once its root has arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            if any(s.name.startswith(("chat", "text_completion")) for s in spans):
                time.sleep(0.6)  # one more export period: the rest of the batch
                with self.lock:
                    return [s for s in self.spans if s.trace_id == trace_id]
            time.sleep(0.05)
        raise AssertionError(f"no trace {trace_id.hex()} arrived")


@pytest.fixture(scope="module")
def receiver(otlp_receiver) -> Receiver:
    return otlp_receiver


@pytest.fixture(scope="module")
def traced(observed_server) -> tuple[EmberServer, Path]:
    return observed_server


def _root(spans: list):
    roots = [s for s in spans if s.name.startswith(("chat", "text_completion"))]
    assert len(roots) == 1, [s.name for s in spans]
    return roots[0]


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = (v.string_value or v.int_value or v.double_value or v.bool_value
                       or [x.string_value for x in v.array_value.values])
    return out


def test_a_request_is_one_trace_whose_children_cover_its_time(traced, receiver):
    """An incoming traceparent is honoured (same trace, the caller's span as parent);
    at least five child spans cover 95% of the request's wall time, the prefill chunks
    sit under the prefill span, and neither the prompt nor the tenant's name is
    exported."""
    server, _ = traced
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model_id, "messages": user(f"Say hello. {SECRET} " + "word " * 300),
        "max_tokens": 12, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY_A}",
                 "traceparent": f"00-{trace_id}-{caller}-01"})
    assert r.status_code == 200, r.text
    spans = receiver.trace(bytes.fromhex(trace_id))
    root = _root(spans)
    assert root.parent_span_id == bytes.fromhex(caller)
    children = [s for s in spans if s.parent_span_id == root.span_id]
    names = {s.name for s in children}
    assert {"ember.prepare", "ember.queue", "ember.admission", "ember.prefill",
            "ember.decode", "ember.respond"} <= names, names
    covered, at = 0, root.start_time_unix_nano
    for s in sorted(children, key=lambda s: s.start_time_unix_nano):
        start, end = max(at, s.start_time_unix_nano), min(s.end_time_unix_nano,
                                                          root.end_time_unix_nano)
        if end > start:
            covered, at = covered + end - start, end
    assert covered >= 0.95 * (root.end_time_unix_nano - root.start_time_unix_nano)
    prefill = next(s for s in children if s.name == "ember.prefill")
    chunks = [s for s in spans if s.name == "ember.prefill.chunk"]
    assert chunks and all(c.parent_span_id == prefill.span_id for c in chunks)
    assert sum(_attrs(c)["ember.chunk.tokens"] for c in chunks) == r.json()["usage"][
        "prompt_tokens"] - r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    a = _attrs(root)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == server.model_id
    assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert a["ember.tenant.hash"] == tenant_hash("tenant-a")
    exported = b"".join(s.SerializeToString() for s in spans)
    assert SECRET.encode() not in exported and b"tenant-a" not in exported


def test_the_request_log_has_a_line_per_request_and_survives_rotation(traced):
    server, log = traced
    client = sdk(server)
    client.chat.completions.create(model=server.model_id, messages=user("One."), max_tokens=3,
                                   temperature=0, extra_body={"ignore_eos": True})
    time.sleep(0.2)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    last = lines[-1]
    assert last["status"] == 200 and last["tenant"] == tenant_hash("tenant-a")
    assert last["completion_tokens"] == 3 and last["finish_reason"] == ["length"]
    assert 0 < last["ttft_s"] <= last["duration_s"] and last["queue_s"] >= 0
    assert len(last["trace_id"]) == 32 and last["error_type"] is None
    log.rename(log.with_suffix(".1"))  # logrotate's move
    client.completions.create(model=server.model_id, prompt="Two.", max_tokens=2,
                              temperature=0, extra_body={"ignore_eos": True})
    time.sleep(0.2)
    again = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(again) == 1 and again[0]["route"] == "/v1/completions"
    assert again[0]["completion_tokens"] == 2


def test_a_client_that_leaves_is_logged_as_499_with_its_partial_trace(traced, receiver):
    server, log = traced
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": server.model_id, "prompt": "Once upon a time", "max_tokens": 400,
            "stream": True, "temperature": 0.8, "ignore_eos": True},
            headers={"Authorization": f"Bearer {KEY_A}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first chunk
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        if lines and lines[-1]["status"] == 499:
            break
        time.sleep(0.05)
    last = lines[-1]
    assert last["status"] == 499 and last["error_type"] == "client_disconnected"
    spans = receiver.trace(bytes.fromhex(last["trace_id"]))
    assert _attrs(_root(spans))["http.response.status_code"] == 499
    engine = [s for s in spans if s.name == "ember.engine"]
    assert len(engine) == 1 and _attrs(engine[0])["ember.incomplete"] is True


def test_a_constrained_requests_decode_span_says_how_long_its_masks_took(traced, receiver):
    server, _ = traced
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model_id, "messages": user("A JSON object, please."), "max_tokens": 16,
        "response_format": {"type": "json_object"}},
        headers={"Authorization": f"Bearer {KEY_A}",
                 "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.status_code == 200, r.text
    decode = next(s for s in receiver.trace(bytes.fromhex(trace_id)) if s.name == "ember.decode")
    assert _attrs(decode)["ember.grammar.mask_seconds"] > 0


def test_a_prefix_read_back_from_the_disk_tier_shows_its_bytes(tiny_gguf: Path,
                                                                e2e_log_dir: Path, receiver,
                                                                tmp_path):
    """A 24-block pool with a disk tier: prompt A (16 blocks) is cached, two other
    prompts push it out of RAM, and A again is admitted with its blocks read back from
    disk: its admission span says how many bytes."""
    serving = _serve(tiny_gguf, e2e_log_dir, "--kv-cache-dir", str(tmp_path / "kv"),
                     "--kv-restore", "always", "--num-kv-blocks", "24",
                     "--otlp-traces-endpoint", receiver.url)
    server = next(serving)
    try:
        def complete(prompt: list[int], trace_id: str = "") -> None:
            headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"} if trace_id else {}
            r = httpx.post(server.url + "/v1/completions", timeout=60, headers=headers,
                           json={"model": server.model_id, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text

        a = list(range(100, 100 + 16 * 16 + 1))
        complete(a)
        for k in (1, 2):
            complete(list(range(1000 * k, 1000 * k + 16 * 16 + 1)))
        trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
        complete(a, trace_id)
        spans = receiver.trace(bytes.fromhex(trace_id))
        admission = _attrs(next(s for s in spans if s.name == "ember.admission"))
        assert admission["ember.kv_disk.restored_bytes"] > 0
        assert admission["ember.prompt.cached_tokens"] == 16 * 16
    finally:
        serving.close()
