"""Hostile input, slow and vanishing clients, bursts: ``ember serve`` answers each with
a clear 4xx (never a 500 or a traceback), keeps every other client served, and frees
what the request held. Real server processes, real sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_server import KEY_A, EmberServer, start_server
from test_server import ABORTS, IDLE, assert_error, user, wait_for_metrics

pytestmark = pytest.mark.slow

METRICS_KEY = "sk-metrics-only"
LIMIT = 8_000_000  # --max-request-bytes of the hardened server


@pytest.fixture(scope="module")
def hard(tiny_gguf: Path, e2e_log_dir: Path) -> Iterator[EmberServer]:
    """The tiny model (2,048-token context) with short read deadlines and a metrics key."""
    server = start_server(tiny_gguf, e2e_log_dir, "--max-request-bytes", str(LIMIT),
                          "--header-timeout", "1", "--body-timeout", "1.5",
                          "--metrics-api-key", METRICS_KEY, "--num-kv-blocks", "256",
                          "--max-num-batched-tokens", "64", "--max-prefill-chunk", "16")
    server.metrics_key = METRICS_KEY
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def post(server: EmberServer, route: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + route, content=content, headers=headers,
                      timeout=kw.pop("timeout", 60), **kw)


def chat(server: EmberServer, **kw: Any) -> dict[str, Any]:
    return {"model": server.model_id, "messages": user("hi"), "max_tokens": 2, **kw}


def no_server_errors(server: EmberServer) -> None:
    m = server.metrics()
    assert not [k for k in m if k.startswith("ember_http_responses_total") and 'status="5' in k]
    assert "Traceback" not in server.log(), server.log()


# ====================================================================== 1. 500s from bad input
def test_json_nested_a_thousand_levels_deep_is_400(hard):
    deep = b"[" * 1000 + b"]" * 1000
    assert_error(post(hard, "/v1/chat/completions", deep), 400, None)
    body = chat(hard, metadata=None)
    raw = json.dumps(body).encode()[:-1] + b', "stop": ' + b"[" * 200 + b"]" * 200 + b"}"
    err = assert_error(post(hard, "/v1/chat/completions", raw), 400, "stop")
    assert "64" in err["message"]
    no_server_errors(hard)


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", lambda m: {"model": "\ud800", "messages": user("hi")}, "model"),
    ("/v1/chat/completions", lambda m: chat_body(m, messages=[{"role": "user",
                                                              "content": "a\udc00b"}]),
     "messages[0].content"),
    ("/v1/responses", lambda m: {"model": m, "input": "hi", "instructions": "\ud83d"},
     "instructions"),
    ("/v1/completions", lambda m: {"model": m, "prompt": "hi", "user": "x\udfff"}, "user"),
])
def test_lone_surrogates_are_400_naming_the_field(hard, route, body, param):
    # json.dumps escapes the surrogate as \\udXXX, exactly what a client would send
    err = assert_error(post(hard, route, body(hard.model_id)), 400, param)
    assert "surrogate" in err["message"]


def chat_body(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": user("hi"), "max_tokens": 2, **kw}


def test_a_surrogate_pair_is_ordinary_text(hard):
    r = post(hard, "/v1/chat/completions", chat(hard, messages=user("smile \U0001f600")))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content", [5, True, {"text": "hi"}])
def test_responses_input_content_of_the_wrong_type_is_400(hard, content):
    body = {"model": hard.model_id, "input": [{"role": "user", "content": content}]}
    assert_error(post(hard, "/v1/responses", body), 400, "input[0].content")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "wide", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}}},
    {"type": "regex", "regex": "(a{1000}){1000}"},
], ids=["1000-optional-properties", "nested-repeat-regex"])
def test_a_grammar_that_fails_during_generation_is_a_400_not_a_500(hard, fmt, stream):
    """Both compile, and both fail during generation: the regex at its second token, the
    schema as soon as a key is started (greedy, the tiny model starts one at once). The
    failure is the request's own: a 400 naming response_format — in-band, as an error
    event, if the stream had begun — never a 500 and never a 200, and the message stays
    readable."""
    r = post(hard, "/v1/chat/completions", chat(hard, max_tokens=12, response_format=fmt,
                                                 stream=stream, temperature=0))
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    if r.status_code == 200:
        assert stream and events and "error" in events[-1], r.text
        err = events[-1]["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "response_format"
    else:
        err = assert_error(r, 400, "response_format")
    assert err["code"] == "invalid_request_during_generation"
    assert "<state>" not in err["message"] and len(err["message"]) < 500
    wait_for_metrics(hard, IDLE)
    no_server_errors(hard)


def test_a_tool_grammar_that_fails_names_tools(hard):
    """A required call to a tool whose argument's pattern the grammar compiler refuses:
    the reply's grammar is the tools', so the 400 names ``tools``, not response_format."""
    args = {"type": "object", "properties": {"code": {"type": "string", "pattern": "("}},
            "required": ["code"]}
    tool = {"type": "function", "function": {"name": "wide", "parameters": args}}
    r = post(hard, "/v1/chat/completions", chat(hard, max_tokens=16, tools=[tool],
                                                 tool_choice="required", temperature=0))
    err = assert_error(r, 400, "tools")
    assert len(err["message"]) < 500, err
    assert err["message"].startswith("invalid tools:"), err
    wait_for_metrics(hard, IDLE)
    no_server_errors(hard)


# ====================================================================== 2. content type, size
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_bodies_that_are_not_json_are_415(hard, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(hard.url + "/v1/chat/completions", content=json.dumps(chat(hard)),
                   headers=headers, timeout=30)
    if content_type is None:  # httpx sends no Content-Type for raw bytes
        assert "content-type" not in r.request.headers
    assert_error(r, 415, None)


def test_json_with_a_charset_is_accepted(hard):
    r = post(hard, "/v1/chat/completions", chat(hard),
             headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_a_body_over_the_limit_is_413_before_it_is_read(hard):
    answer = _declare_oversized_body(hard)  # answered without sending a single body byte
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"--max-request-bytes" in answer


def _declare_oversized_body(hard: EmberServer, headers: bytes = b"") -> bytes:
    """Send only the head of a chat request declaring a body over the limit (plus
    ``headers``); the whole response."""
    with socket.create_connection(("127.0.0.1", int(hard.url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\n" + headers +
                  b"Content-Length: %d\r\n\r\n" % (LIMIT + 1))
        s.settimeout(10)
        return _read_response(s)


def _read_response(s: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_chunked_body_over_the_limit_is_413(hard):
    def chunks() -> Iterator[bytes]:
        for _ in range(LIMIT // 65536 + 2):
            yield b" " * 65536

    r = httpx.post(hard.url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert_error(r, 413, None)


TRIES = 50


def test_every_client_reads_the_413_of_an_oversized_body(hard):
    """A body 1 MB over the limit, 50 times each from http.client, requests, httpx
    (sync, and async with other requests in flight) and the openai SDK: every time the
    client reads the 413 JSON error, never a reset or a broken pipe (the server reads
    and drops the body before answering)."""
    import http.client

    import openai
    import requests

    port = int(hard.url.rsplit(":", 1)[1])
    body = json.dumps(chat(hard, messages=user("x" * (LIMIT + 1_000_000)))).encode()
    headers = {"Content-Type": "application/json"}

    def with_http_client() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            r = conn.getresponse()
            assert json.loads(r.read())["error"]["code"] == "request_too_large"
            return r.status
        finally:
            conn.close()

    def with_requests() -> int:
        r = requests.post(hard.url + "/v1/chat/completions", data=body, headers=headers,
                          timeout=30)
        assert r.json()["error"]["code"] == "request_too_large"
        return r.status_code

    def with_httpx() -> int:
        return post(hard, "/v1/chat/completions", body).status_code

    sdk = openai.OpenAI(base_url=hard.url + "/v1", api_key="none", max_retries=0, timeout=30)

    def with_openai() -> int:
        try:
            sdk.chat.completions.create(model=hard.model_id, max_tokens=2,
                                        messages=user("x" * (LIMIT + 1_000_000)))
        except openai.APIStatusError as e:
            return e.status_code
        return 200

    for client in (with_http_client, with_requests, with_httpx, with_openai):
        statuses = [client() for _ in range(TRIES)]
        assert statuses == [413] * TRIES, (client.__name__, statuses)

    # ten connections at a time: with a hundred, this one event loop writing 450 MB fell
    # more than the server's 1 s header / 1.5 s body deadlines behind on some of them, and
    # the server rightly cut those as slow senders (a 408, a closed connection)
    async def with_async_httpx() -> list[int]:
        async with httpx.AsyncClient(base_url=hard.url, timeout=60,
                                     limits=httpx.Limits(max_connections=10)) as ac:
            async def big() -> int:
                r = await ac.post("/v1/chat/completions", content=body, headers=headers)
                return r.status_code

            async def small() -> int:
                return (await ac.post("/v1/chat/completions", json=chat(hard))).status_code

            got = await asyncio.gather(*(f() for _ in range(TRIES) for f in (big, small)))
            return list(got)

    statuses = asyncio.run(with_async_httpx())
    assert statuses == [413, 200] * TRIES, statuses
    no_server_errors(hard)


def test_an_oversized_body_still_arriving_after_the_body_deadline_is_drained_to_its_end(hard):
    """A body over the limit sent steadily over 2.5 s, past the 1.5 s --body-timeout: the
    server keeps reading and dropping it while it arrives (draining has its own bounds),
    so the client sends all of it and then reads the 413, not a reset."""
    pieces, size = 25, LIMIT + 1
    with socket.create_connection(("127.0.0.1", int(hard.url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size)
        for i in range(pieces):
            s.sendall(b" " * (size // pieces + (size % pieces if i == pieces - 1 else 0)))
            time.sleep(0.1)
        s.settimeout(10)
        answer = _read_response(s)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    no_server_errors(hard)


def test_a_client_expecting_100_continue_gets_the_413_without_sending_the_body(hard):
    # a 413, not "100 Continue": the body was not asked for
    answer = _declare_oversized_body(hard, b"Expect: 100-continue\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


# ====================================================================== 2. one user freezes nobody
def _trickled(body: dict[str, Any], pieces: int = 25, pause: float = 0.02):
    """The body's JSON sent in ``pieces`` with a pause between them: the request then
    lasts at least ``pieces * pause`` seconds, however fast the machine."""
    data = json.dumps(body).encode()
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        yield data[i:i + step]
        time.sleep(pause)


def test_health_stays_responsive_while_a_5mb_prompt_is_rejected(hard):
    """/health keeps answering while each 5 MB prompt is read, measured and refused:
    answers arrive during each refusal, and no health request waits half as long as
    the refusal takes (before, /health froze for the whole 27 s of one). Each body is
    trickled in over half a second or more, so the bound is relative to a span the
    test sets, not to this machine's speed."""
    answered: list[tuple[float, float]] = []  # (sent, answered) of each /health
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t = time.monotonic()
                assert c.get(hard.url + "/health").status_code == 200
                answered.append((t, time.monotonic()))
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    refusals: list[tuple[float, float]] = []
    try:
        time.sleep(0.2)
        big = "lorem ipsum " * (5_000_000 // 12)
        for route, body, param in (
                ("/v1/chat/completions", chat(hard, messages=user(big)), "messages"),
                ("/v1/completions", {"model": hard.model_id, "prompt": big}, "prompt")):
            t = time.monotonic()
            r = httpx.post(hard.url + route, content=_trickled(body), timeout=60,
                           headers={"Content-Type": "application/json"})
            refusals.append((t, time.monotonic()))
            assert_error(r, 400, param)
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join(60)
    for start, end in refusals:
        assert len([a for _, a in answered if start < a < end]) >= 3
        waited = [a - s for s, a in answered if start < a and s < end]
        assert max(waited) < (end - start) / 2, (max(waited), end - start)


def test_a_prompt_that_passes_the_character_bound_is_still_measured_in_tokens(hard):
    text = "x " * 3000  # 6,000 characters, about 3,000 tokens: over the 2,048 window
    err = assert_error(post(hard, "/v1/completions",
                            {"model": hard.model_id, "prompt": text, "max_tokens": 1}),
                       400, "max_tokens")
    assert "2048" in err["message"]


def test_a_short_request_is_served_while_a_long_prompt_prefills(smol_server):
    """Admission does not wait for another request's prefill to finish: the real model
    takes four steps (seconds) over a 1,600-token prompt; a one-token request sent
    during the first is answered at the second."""
    server, auth = smol_server, {"Authorization": f"Bearer {KEY_A}"}
    wait_for_metrics(server, IDLE)
    long_prompt = [100 + i % 20000 for i in range(1600)]  # 4 steps of 512
    order: list[str] = []

    def long_request() -> None:
        r = post(server, "/v1/completions", {"model": server.model_id, "prompt": long_prompt,
                                             "max_tokens": 1}, headers=auth)
        assert r.status_code == 200, r.text
        order.append("long")

    t = threading.Thread(target=long_request)
    t.start()
    wait_for_metrics(server, {"ember_requests_running": 1})
    r = post(server, "/v1/completions", {"model": server.model_id, "prompt": "Hi",
                                         "max_tokens": 1}, headers=auth)
    assert r.status_code == 200, r.text
    order.append("short")
    t.join(120)
    assert order == ["short", "long"]


# ====================================================================== 3 + 5. disconnects
def _raw(server: EmberServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))


def test_disconnect_before_the_body_is_read_is_a_client_abort(hard):
    before = hard.metrics()
    with _raw(hard) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"mo")
        time.sleep(0.2)
    m = wait_for_metrics(hard, {"ember_client_disconnects_total":
                                before["ember_client_disconnects_total"] + 1})
    assert m[_route_status("/v1/chat/completions", 499)] >= 1
    no_server_errors(hard)
    assert "client disconnected: POST /v1/chat/completions" in hard.log()


def _route_status(route: str, status: int) -> str:
    return f'ember_http_responses_total{{route="{route}",status="{status}"}}'


def test_a_non_streamed_request_is_aborted_as_soon_as_its_client_leaves(hard):
    """Output flows the whole time (no idle gap to notice the disconnect in)."""
    before = wait_for_metrics(hard, IDLE)
    aborts = before[ABORTS]
    body = chat(hard, max_tokens=1800, ignore_eos=True)  # ~10 s of decoding
    with pytest.raises(httpx.TimeoutException):
        post(hard, "/v1/chat/completions", body, timeout=0.8)
    # (the wait raises if the abort is not seen within 5 s)
    m = wait_for_metrics(hard, {**IDLE, ABORTS: aborts + 1}, timeout=5)
    # it stopped early: far fewer than its 1,800 tokens were generated
    generated = m["ember_generation_tokens_total"] - before["ember_generation_tokens_total"]
    assert generated < 1800 // 2, generated
    no_server_errors(hard)


# ====================================================================== 6. smaller exposures
def test_slow_request_headers_are_cut_off(hard):
    before = hard.metrics()["ember_slow_connections_closed_total"]
    with _raw(hard) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(5)
        t = time.monotonic()
        for _ in range(20):  # a byte now and then never completes the headers
            try:
                s.sendall(b"X")
            except OSError:
                break
            if s.recv(1024) == b"":
                break
        closed_after = time.monotonic() - t
    assert closed_after < 4  # --header-timeout 1
    m = hard.metrics()
    assert m["ember_slow_connections_closed_total"] == before + 1


def test_a_slow_body_is_408(hard):
    with _raw(hard) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        s.settimeout(10)
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 408"), head[:200]


def test_metrics_need_the_metrics_key(hard):
    assert httpx.get(hard.url + "/metrics", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer sk-nope"}
    assert httpx.get(hard.url + "/metrics", headers=wrong, timeout=10).status_code == 401
    ok = {"Authorization": f"Bearer {METRICS_KEY}"}
    assert httpx.get(hard.url + "/metrics", headers=ok, timeout=10).status_code == 200


def test_metrics_need_an_api_key_when_the_server_has_keys(smol_server):
    from e2e_server import KEY_B

    assert httpx.get(smol_server.url + "/metrics", timeout=10).status_code == 401
    ok = {"Authorization": f"Bearer {KEY_B}"}
    assert httpx.get(smol_server.url + "/metrics", headers=ok, timeout=10).status_code == 200


def test_the_openapi_document_describes_every_body(hard):
    doc = httpx.get(hard.url + "/openapi.json", timeout=10).json()
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        op = doc["paths"][route]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert schema["additionalProperties"] is False and schema["required"]
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert doc["components"]["schemas"][ok.rsplit("/", 1)[1]]["properties"]
        assert {"400", "401", "413", "415", "429"} <= set(op["responses"])
    for route in ("/v1/models", "/health"):
        assert doc["paths"][route]["get"]["responses"]["200"]["content"]


# ====================================================================== 4. bursts
TOKENS = 400  # an accepted request's generation: hundreds of steps, far longer than a refusal
def test_a_burst_beyond_the_queue_is_refused_at_once_and_accepted_work_is_kept(
        tiny_mech_server):
    """200 requests at once against one sequence slot and a one-place queue. "At once"
    is measured against the same run, not a clock: the refusals come back while the
    first accepted request is still generating (before: they waited behind it, a
    median of 21 s)."""
    server = tiny_mech_server
    wait_for_metrics(server, IDLE)
    body = json.dumps({"model": server.model_id, "prompt": "hello", "max_tokens": TOKENS,
                       "ignore_eos": True}).encode()

    async def burst() -> list[tuple[int, float, dict[str, Any]]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            async def one() -> tuple[int, float, dict[str, Any]]:
                t = time.monotonic()
                r = await c.post(server.url + "/v1/completions", content=body,
                                 headers={"Content-Type": "application/json"})
                return r.status_code, time.monotonic() - t, r.json()
            return await asyncio.gather(*(one() for _ in range(200)))

    results = asyncio.run(burst())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses
    for status, _, body_ in results:
        if status == 200:  # accepted work is never lost
            assert body_["usage"]["completion_tokens"] == TOKENS
    refused = sorted(t for s, t, _ in results if s == 429)
    accepted = sorted(t for s, t, _ in results if s == 200)
    assert statistics.median(refused) < accepted[0], (refused[-5:], accepted)
    wait_for_metrics(server, IDLE, timeout=60)
    assert server.healthy()
