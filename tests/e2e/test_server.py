"""End-to-end tests of ``ember serve``: real server processes, real HTTP, the official
``openai`` SDK for the normal paths and raw ``httpx`` for the error paths.

Servers (see conftest.py) are shared by the session: the real SmolLM2-135M behind two
API keys for everything about outputs, and the tiny random-weight model wherever the
check is about mechanics (overload, disconnects, error paths, fuzzing, shutdown).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from e2e_server import KEY_A, KEY_B, EmberServer, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

QUESTION = "What is 2+2? Answer briefly."
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------------- helpers
def sdk(server: EmberServer, key: str | None = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def client(smol_server: EmberServer) -> openai.OpenAI:
    return sdk(smol_server)


@pytest.fixture(scope="module")
def model(smol_server: EmberServer) -> str:
    return smol_server.model_id


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    """An OpenAI-shaped error with this status and ``param``; returns ``error``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] == param, err
    return err


def wait_for_metrics(server: EmberServer, want: dict[str, float], timeout: float = 10.0
                     ) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if all(m.get(k) == v for k, v in want.items()):
            return m
        if time.monotonic() > deadline:
            got = {k: m.get(k) for k in want}
            raise AssertionError(f"metrics never reached {want}; last {got}")
        time.sleep(0.05)


def sse_data(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ====================================================================== 1. chat
def test_chat_stream_deltas_concatenate_to_the_greedy_reply(client, model):
    kw = dict(model=model, messages=user(QUESTION), temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert text and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == full.choices[0].finish_reason
    assert all(r is None for r in reasons[:-1])
    last = chunks[-1]  # the usage chunk: no choices, the whole request's usage
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


# ====================================================================== 2. completions
def test_completions_prompt_text_and_token_ids_agree_streamed_or_not(client, model,
                                                                      smollm2_file):
    from ember.tokenizer import Tokenizer

    prompt = "The capital of France is"
    kw = dict(model=model, temperature=0, max_tokens=10)
    by_text = client.completions.create(prompt=prompt, **kw)
    assert by_text.object == "text_completion"
    text = by_text.choices[0].text
    assert text and by_text.choices[0].finish_reason in ("stop", "length")

    tok = Tokenizer.from_gguf(smollm2_file)
    ids = tok.encode(prompt, add_bos=tok.add_bos)
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_ids.choices[0].text == text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)

    chunks = list(client.completions.create(prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        by_text.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == by_text.usage.completion_tokens


# ====================================================================== 3. responses
def test_responses_non_streaming_has_text_and_usage(client, model):
    resp = client.responses.create(model=model, input=QUESTION, instructions="Be concise.",
                                   max_output_tokens=16, temperature=0)
    assert resp.object == "response"
    assert resp.status in ("completed", "incomplete")
    assert resp.output_text
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert isinstance(resp.usage.input_tokens_details.cached_tokens, int)
    assert resp.instructions == "Be concise."


RESPONSE_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done", "response.completed",
]


def test_responses_stream_emits_the_full_event_sequence_in_order(client, model):
    kw = dict(model=model, input=QUESTION, max_output_tokens=48, temperature=0)
    final = client.responses.create(**kw)
    assert final.status == "completed", "the greedy reply should end before the cap"
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == RESPONSE_EVENTS, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    completed = events[-1].response
    assert deltas == done.text == completed.output_text == final.output_text
    assert events[0].response.status == "in_progress"
    assert completed.status == "completed"
    assert completed.usage.output_tokens == final.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {completed.output[0].id}


def test_responses_input_as_message_items_matches_string_input(client, model):
    kw = dict(model=model, max_output_tokens=12, temperature=0)
    plain = client.responses.create(input=QUESTION, **kw).output_text
    items = client.responses.create(input=[{"role": "user", "content": QUESTION}], **kw)
    parts = client.responses.create(input=[{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": QUESTION}]}], **kw)
    assert plain and items.output_text == plain and parts.output_text == plain


# ====================================================================== 4. n=2
def test_n2_returns_two_seeded_choices_sharing_one_prompt(client, model, smol_server):
    # A fresh prompt: only the chat template's system preamble (one block, cached by
    # the warm-up) can be found in the cache by the first choice.
    warm_up = user(f"[{uuid.uuid4().hex}]")
    client.chat.completions.create(model=model, messages=warm_up, max_tokens=1)
    messages = user(f"[{uuid.uuid4().hex}] Write one sentence about the sea and the sky, "
                    "the wind and the waves, the sun and the moon, the stars at night.")
    before = smol_server.metrics()
    two = client.chat.completions.create(model=model, messages=messages, n=2, logprobs=True,
                                         temperature=0.9, seed=7, max_tokens=12)
    after = smol_server.metrics()
    hits = after["ember_prefix_cache_hits_total"] - before["ember_prefix_cache_hits_total"]
    computed = after["ember_prefill_tokens_total"] - before["ember_prefill_tokens_total"]
    assert [c.index for c in two.choices] == [0, 1]
    a, b = (c.message.content for c in two.choices)
    assert a and b and a != b  # choice j samples with seed + j
    p = two.usage.prompt_tokens
    single = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert p == single.usage.prompt_tokens  # counted once, not per choice
    assert 2 <= two.usage.completion_tokens <= 24
    # The first choice hits the preamble only (16 tokens) and computes the rest of the
    # prompt; the second is forked from it and computes none of it.
    assert p > 64
    assert (hits, computed) == (16, p - 16)
    # Each choice reproduces alone with its own seed.
    for j, choice in enumerate(two.choices):
        again = client.chat.completions.create(model=model, messages=messages, logprobs=True,
                                               temperature=0.9, seed=7 + j, max_tokens=12)
        # with the logprobs, a failure tells a near-tie draw from logits that differ
        assert ([(t.token, t.logprob) for t in again.choices[0].logprobs.content]
                == [(t.token, t.logprob) for t in choice.logprobs.content]), f"choice {j}"


# ====================================================================== 5. logprobs
def test_chat_logprobs_have_the_openai_shape(client, model):
    r = client.chat.completions.create(model=model, messages=user(QUESTION), temperature=0,
                                       max_tokens=8, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    raw = b""
    for lp in content:
        assert isinstance(lp.token, str) and lp.logprob <= 0
        assert isinstance(lp.bytes, list) and all(0 <= x < 256 for x in lp.bytes)
        assert len(lp.top_logprobs) == 3
        tops = [t.logprob for t in lp.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        # greedy: the chosen token is the most likely one
        assert lp.top_logprobs[0].bytes == lp.bytes
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob, abs=1e-4)
        raw += bytes(lp.bytes)
    text = choice.message.content
    # One entry per generated token, the end-of-turn token included when the model
    # stopped on it (as vLLM does; it counts in completion_tokens but not in the text).
    if choice.finish_reason == "stop" and content[-1].token == "<|im_end|>":
        raw = raw[:-len(content[-1].bytes)]
    assert raw.decode("utf-8", errors="replace") == text


def test_completion_logprobs_have_the_legacy_shape(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is",
                                  temperature=0, max_tokens=6, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy
        assert token in top


# ====================================================================== 6. stop
def test_stop_string_is_excluded_and_finishes_with_stop(client, model):
    kw = dict(model=model, messages=user(QUESTION), temperature=0, max_tokens=24)
    free = client.chat.completions.create(**kw).choices[0].message.content
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[2]
    r = client.chat.completions.create(**kw, stop=[stop])
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert stop not in text
    assert text == free[:free.index(stop)]
    chunks = list(client.chat.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


# ====================================================================== 7. seed
def test_same_seed_reproduces_and_another_seed_differs(client, model):
    kw = dict(model=model, messages=user("Tell me a short story about a dragon."),
              temperature=0.8, max_tokens=12)
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    c = client.chat.completions.create(**kw, seed=4321).choices[0].message.content
    assert a and a == b
    assert c != a


# ====================================================================== 8. prefix cache
def test_second_chat_turn_reuses_the_cached_history(client, model):
    history = user(f"[{uuid.uuid4().hex}] Name three colours of the rainbow.")
    first = client.chat.completions.create(model=model, messages=history, temperature=0,
                                           max_tokens=16)
    reply = first.choices[0].message.content
    history += [{"role": "assistant", "content": reply},
                {"role": "user", "content": "And two more?"}]
    second = client.chat.completions.create(model=model, messages=history, temperature=0,
                                            max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    # at least every full block of the first turn's prompt (which is a prefix of this one)
    assert cached >= 16 * (first.usage.prompt_tokens // 16)
    assert cached < second.usage.prompt_tokens


# ====================================================================== 9. tenants and auth
def test_prefix_cache_is_isolated_per_tenant(smol_server, model):
    long_prompt = f"[{uuid.uuid4().hex}] " + "The quick brown fox jumps over the lazy dog. " * 12
    kw = dict(model=model, messages=user(long_prompt), temperature=0, max_tokens=1)
    a, b = sdk(smol_server, KEY_A), sdk(smol_server, KEY_B)
    a1 = a.chat.completions.create(**kw)
    a2 = a.chat.completions.create(**kw)
    p = a2.usage.prompt_tokens
    assert p > 100
    assert a2.usage.prompt_tokens_details.cached_tokens >= 16 * ((p - 1) // 16) > 0
    assert a1.usage.prompt_tokens_details.cached_tokens < a2.usage.prompt_tokens_details \
        .cached_tokens
    b1 = b.chat.completions.create(**kw)  # key B's first request ever (see KEY_B)
    assert b1.usage.prompt_tokens == p
    assert b1.usage.prompt_tokens_details.cached_tokens == 0
    assert b1.choices[0].message.content == a1.choices[0].message.content
    b2 = b.chat.completions.create(**kw)  # B now has its own copy
    assert b2.usage.prompt_tokens_details.cached_tokens == \
        a2.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("headers", [
    pytest.param({}, id="missing"),
    pytest.param({"Authorization": "Bearer sk-wrong"}, id="wrong-key"),
    pytest.param({"Authorization": KEY_A}, id="no-scheme"),
    pytest.param({"Authorization": f"Basic {KEY_A}"}, id="basic-scheme"),
    pytest.param({"Authorization": "Bearer"}, id="bearer-without-key"),
    pytest.param({"Authorization": f"Bearer {KEY_A}x"}, id="key-with-suffix"),
    pytest.param({"Authorization": f"Bearer {KEY_A[:-1]}"}, id="key-prefix"),
    # sent as raw bytes: a key followed by NBSP or NEL is not the key (no Unicode strip)
    pytest.param({"Authorization": f"Bearer {KEY_A}".encode() + b"\xa0"}, id="key-nbsp"),
    pytest.param({"Authorization": f"Bearer {KEY_A}".encode() + b"\x85"}, id="key-nel"),
])
def test_requests_without_a_valid_key_get_401(smol_server, model, headers):
    body = {"model": model, "messages": user("hi"), "max_tokens": 1}
    for path, payload in [("/v1/chat/completions", body), ("/v1/completions",
                          {"model": model, "prompt": "hi", "max_tokens": 1}),
                          ("/v1/responses", {"model": model, "input": "hi"})]:
        r = httpx.post(smol_server.url + path, json=payload, headers=headers, timeout=30)
        err = assert_error(r, 401, None)
        assert err["code"] == "invalid_api_key"
    assert_error(httpx.get(smol_server.url + "/v1/models", headers=headers), 401, None)
    assert smol_server.healthy()


def test_sdk_raises_authentication_error_on_a_wrong_key(smol_server, model):
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(smol_server, "sk-wrong").chat.completions.create(model=model, messages=user("hi"),
                                                             max_tokens=1)
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        sdk(smol_server, "sk-wrong").models.list()


# ====================================================================== 10. 429
def test_burst_beyond_the_queue_gets_429_and_the_server_recovers(tiny_mech_server):
    server = tiny_mech_server
    rejected_before = server.metrics()["ember_rejected_requests_total"]
    body = {"model": server.model_id, "prompt": "hello", "max_tokens": 120, "ignore_eos": True}
    n = 8
    barrier = threading.Barrier(n)
    results: list[httpx.Response | BaseException] = [None] * n  # type: ignore[list-item]

    def fire(i: int) -> None:
        try:
            with httpx.Client(timeout=60) as c:
                barrier.wait()
                results[i] = c.post(server.url + "/v1/completions", json=body)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(r, httpx.Response) for r in results), results
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses, statuses
    for r in results:
        if r.status_code == 429:
            assert r.headers.get("retry-after", "").isdigit()
            err = assert_error(r, 429, None)
            assert err["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 120
    assert server.healthy()
    m = wait_for_metrics(server, {"ember_requests_running": 0, "ember_requests_waiting": 0})
    assert m["ember_rejected_requests_total"] - rejected_before == statuses.count(429) > 0
    r = httpx.post(server.url + "/v1/completions",
                   json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


# ====================================================================== 11. disconnects
def _long_stream(server: EmberServer, max_tokens: int = 1500) -> Any:
    """A streamed chat of ``max_tokens`` tokens (seconds on the tiny model: ~6 ms/token)."""
    body = {"model": server.model_id, "messages": user("hello"), "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30)


ABORTS = 'ember_request_finished_total{finish_reason="abort"}'
IDLE = {"ember_kv_blocks_used": 0, "ember_requests_running": 0, "ember_requests_waiting": 0}


def test_disconnect_mid_stream_frees_the_blocks(tiny_mech_server):
    server = tiny_mech_server
    aborts = server.metrics()[ABORTS]
    wait_for_metrics(server, IDLE)
    with _long_stream(server) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(8)) if line.startswith("data:")]
        assert len(data) >= 3
        m = server.metrics()
        assert m["ember_requests_running"] == 1 and m["ember_kv_blocks_used"] > 0
    # leaving the block closed the connection mid-stream
    m = wait_for_metrics(server, IDLE, timeout=10)
    assert m[ABORTS] == aborts + 1
    assert server.healthy()


def test_disconnect_before_the_first_token_frees_the_request(tiny_mech_server):
    """A non-streaming request that times out client-side while still queued (the one
    sequence slot is taken) is dropped from the queue; then the stream's blocks go too."""
    server = tiny_mech_server
    aborts = server.metrics()[ABORTS]
    wait_for_metrics(server, IDLE)
    outcome: list[BaseException | httpx.Response] = []

    def queued() -> None:
        try:
            outcome.append(httpx.post(server.url + "/v1/completions", timeout=1.5, json={
                "model": server.model_id, "prompt": "hi", "max_tokens": 50}))
        except BaseException as e:
            outcome.append(e)

    with _long_stream(server) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep it referenced: dropping it closes the connection
        next(lines)
        t = threading.Thread(target=queued)
        t.start()
        wait_for_metrics(server, {"ember_requests_waiting": 1, "ember_requests_running": 1},
                         timeout=5)
        t.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], httpx.TimeoutException), outcome
        # the queued request is gone while the stream still runs
        wait_for_metrics(server, {"ember_requests_waiting": 0, "ember_requests_running": 1},
                         timeout=10)
    m = wait_for_metrics(server, IDLE, timeout=10)
    assert m[ABORTS] == aborts + 2
    assert server.healthy()


# ====================================================================== 12. errors
def _chat(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": user("hi"), "max_tokens": 2, **kw}


ERROR_CASES = [
    # (id, route, body (callable of the model id) or raw bytes, status, param)
    ("unknown-model", "chat", lambda m: _chat("no-such-model"), 404, "model"),
    ("unknown-model-completions", "completions",
     lambda m: {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("unknown-model-responses", "responses", lambda m: {"model": "nope", "input": "hi"},
     404, "model"),
    ("malformed-json", "chat", b'{"model": "x", "messages": [', 400, None),
    ("not-utf8", "chat", b"\xff\xfe{}", 400, None),
    ("body-not-object", "chat", b"[1, 2, 3]", 400, None),
    ("max-tokens-string", "chat", lambda m: _chat(m, max_tokens="x"), 400, "max_tokens"),
    ("temperature-string", "chat", lambda m: _chat(m, temperature="hot"), 400, "temperature"),
    ("messages-string", "chat", lambda m: {"model": m, "messages": "hi"}, 400, "messages"),
    ("negative-max-tokens", "chat", lambda m: _chat(m, max_tokens=-5), 400, "max_tokens"),
    ("empty-messages", "chat", lambda m: {"model": m, "messages": []}, 400, "messages"),
    ("missing-messages", "chat", lambda m: {"model": m}, 400, "messages"),
    ("unknown-parameter", "chat", lambda m: _chat(m, foo=1), 400, "foo"),
    ("tools-duplicate", "chat", lambda m: _chat(m, tool_choice="auto", tools=[{
        "type": "function", "function": {"name": "f", "parameters": {}}}] * 2), 400,
     "tools[1].function.name"),
    ("logit-bias", "chat", lambda m: _chat(m, logit_bias={"42": 5}), 400, "logit_bias"),
    ("image-part", "chat", lambda m: {"model": m, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url",
                                      "image_url": {"url": "https://x/y.png"}}]}]},
     400, "messages[0].content[1]"),
    ("bad-role", "chat", lambda m: {"model": m, "messages": [{"role": "robot",
                                                              "content": "hi"}]},
     400, "messages[0].role"),
    ("n-zero", "chat", lambda m: _chat(m, n=0), 400, "n"),
    ("top-logprobs-without-logprobs", "chat", lambda m: _chat(m, top_logprobs=2), 400,
     "top_logprobs"),
    ("stream-options-without-stream", "chat",
     lambda m: _chat(m, stream_options={"include_usage": True}), 400, "stream_options"),
    ("completions-missing-prompt", "completions", lambda m: {"model": m}, 400, "prompt"),
    ("completions-token-outside-vocab", "completions",
     lambda m: {"model": m, "prompt": [1, 2, 10**9], "max_tokens": 2}, 400, "prompt"),
    ("completions-logprobs-too-many", "completions",
     lambda m: {"model": m, "prompt": "hi", "logprobs": 9}, 400, "logprobs"),
    ("responses-input-number", "responses", lambda m: {"model": m, "input": 5}, 400, "input"),
    ("responses-unknown-parameter", "responses",
     lambda m: {"model": m, "input": "hi", "bar": True}, 400, "bar"),
    ("responses-previous-id", "responses",
     lambda m: {"model": m, "input": "hi", "previous_response_id": "resp_1"}, 400,
     "previous_response_id"),
]
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses"}


@pytest.mark.parametrize("route,body,status,param",
                         [pytest.param(*c[1:], id=c[0]) for c in ERROR_CASES])
def test_bad_requests_are_4xx_naming_the_param(tiny_small_server, route, body, status, param):
    server = tiny_small_server
    url = server.url + ROUTES[route]
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"},
                       timeout=30)
    else:
        r = httpx.post(url, json=body(server.model_id), timeout=30)
    assert_error(r, status, param)
    assert server.healthy()


@pytest.mark.parametrize("route,cap", [("chat", "max_tokens"),
                                       ("chat", "max_completion_tokens"),
                                       ("completions", "max_tokens"),
                                       ("responses", "max_output_tokens")])
def test_prompt_plus_max_tokens_beyond_the_context_window_is_400(tiny_small_server, route,
                                                                 cap):
    server = tiny_small_server  # --max-model-len 64
    m = server.model_id
    body = {"chat": {"model": m, "messages": user("hi")},
            "completions": {"model": m, "prompt": "hello there"},
            "responses": {"model": m, "input": "hi"}}[route]
    body[cap] = 63
    r = httpx.post(server.url + ROUTES[route], json=body, timeout=30)
    err = assert_error(r, 400, cap)  # named as the request named it
    numbers = re.findall(r"\d+", err["message"])
    assert "64" in numbers and "63" in numbers, err["message"]
    assert f"{cap} (63)" in err["message"]
    assert server.healthy()


def test_prompt_alone_beyond_the_context_window_is_400(tiny_small_server):
    server = tiny_small_server
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": server.model_id, "prompt": list(range(100, 180)), "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in ("prompt", "max_tokens"), err
    assert "80" in re.findall(r"\d+", err["message"]) and "64" in err["message"]
    assert server.healthy()


# ====================================================================== 13. fuzz
MODEL_SENTINEL = "<<model>>"
_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)


def _weighted(often: st.SearchStrategy, rarely: st.SearchStrategy, odds: int = 4
              ) -> st.SearchStrategy:
    """``often`` about odds-1 times in odds (``st.one_of`` dedups repeated branches)."""
    return st.sampled_from(range(odds)).flatmap(lambda k: rarely if k == 0 else often)


def _mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid-looking values most of the time, anything JSON otherwise."""
    return _weighted(valid, _json, odds=6)


_text = st.text(max_size=16)
_part = st.fixed_dictionaries(
    {"type": _mostly(st.sampled_from(["text", "input_text", "output_text", "image_url"]))},
    optional={"text": _mostly(_text), "image_url": _json})
_message = st.fixed_dictionaries(
    {"role": _mostly(st.sampled_from(["system", "developer", "user", "assistant"])),
     "content": _mostly(_text | st.lists(_part, max_size=2))},
    optional={"name": _leaf, "type": st.just("message") | _leaf, "zzz": _json})
_messages = _mostly(st.lists(_message, min_size=1, max_size=3))
_tokens = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
_COMMON = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(-(2**65), 2**65), "stream": st.booleans(),
    "user": _text,
}
_SAMPLING = {
    **_COMMON,
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "stop": _text | st.lists(_text, max_size=4), "n": st.integers(1, 3),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-5, 5), max_size=1),
    "ignore_eos": st.booleans(),
}
_ROUTE_FIELDS = {
    "chat": {"messages": _messages, **_SAMPLING,
             "max_tokens": st.integers(1, 3), "max_completion_tokens": st.integers(1, 3),
             "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
             "tools": st.lists(_json, max_size=1), "tool_choice": st.sampled_from(["none",
                                                                                 "auto"]),
             "response_format": st.just({"type": "text"}), "modalities": st.just(["text"])},
    "completions": {"prompt": _text | _tokens | st.lists(_text, min_size=1, max_size=2)
                    | st.lists(_tokens, min_size=1, max_size=2), **_SAMPLING,
                    "max_tokens": st.integers(1, 3), "logprobs": st.integers(0, 5),
                    "echo": st.booleans(), "suffix": _text, "best_of": st.integers(1, 2)},
    "responses": {"input": _text | st.lists(_message, min_size=1, max_size=2), **_COMMON,
                  "instructions": _text, "max_output_tokens": st.integers(1, 3),
                  "text": st.just({"format": {"type": "text"}}),
                  "metadata": st.dictionaries(st.text(max_size=4), _text, max_size=2),
                  "store": st.booleans(), "tool_choice": st.just("none"),
                  "previous_response_id": _text, "reasoning": _json},
}
_PRIMARY = {"chat": "messages", "completions": "prompt", "responses": "input"}


_valid_message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": _text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                       "text": _text}), max_size=2)})
_stops = st.text(min_size=1, max_size=4)
_VALID = {  # where the route's strategy above also draws refused values
    "messages": st.lists(_valid_message, min_size=1, max_size=3),
    "input": _text | st.lists(_valid_message.map(
        lambda m: {**m, "content": m["content"] if isinstance(m["content"], str) else [
            {**p, "type": "input_text"} for p in m["content"]]}), min_size=1, max_size=2),
    "stop": _stops | st.lists(_stops, max_size=4),
}
# fields a valid request may carry without being refused outright
_REFUSED = {"logit_bias", "tools", "tool_choice", "echo", "suffix", "best_of", "store",
            "previous_response_id", "reasoning"}


def _wild_body(route: str) -> st.SearchStrategy:
    """Every field the route knows, mostly valid-looking, plus unknown keys."""
    fields = _ROUTE_FIELDS[route]
    primary = _PRIMARY[route]
    required = {"model": _mostly(st.just(MODEL_SENTINEL)), primary: _mostly(fields[primary])}
    optional = {k: _mostly(v) for k, v in fields.items() if k != primary}
    extra = _weighted(st.just({}), st.dictionaries(st.text(max_size=8), _json, min_size=1,
                                                   max_size=2))
    return st.tuples(st.fixed_dictionaries(required, optional=optional), extra).map(
        lambda pair: {**pair[1], **pair[0]})


def _valid_body(route: str) -> st.SearchStrategy:
    """Well-typed requests with random content: these reach the engine."""
    fields = _ROUTE_FIELDS[route]
    primary = _PRIMARY[route]
    optional = {k: _VALID.get(k, v) for k, v in fields.items()
                if k != primary and k not in _REFUSED}
    required = {"model": st.just(MODEL_SENTINEL), primary: _VALID.get(primary, fields[primary])}
    return st.fixed_dictionaries(required, optional=optional)


def _payload_for(route: str) -> st.SearchStrategy:
    bodies = _weighted(_valid_body(route), _wild_body(route), odds=2)
    return _weighted(bodies, _json | st.binary(max_size=40), odds=8)


_request = st.sampled_from(sorted(_PRIMARY)).flatmap(
    lambda route: st.tuples(st.just(route), _payload_for(route)))


def _prepare(payload: Any, model: str, route: str) -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, dict):
        payload = dict(payload)
        if payload.get("model") == MODEL_SENTINEL:
            payload["model"] = model
        # keep valid-looking requests short (the context window of 64 bounds the rest)
        cap = "max_output_tokens" if route == "responses" else "max_tokens"
        payload.setdefault(cap, 2)
    return json.dumps(payload).encode()  # NaN/Infinity included: Python's json accepts them


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])
@given(request=_request)
def test_fuzzed_bodies_never_get_a_5xx(tiny_small_server, request):
    server = tiny_small_server
    route, payload = request
    content = _prepare(payload, server.model_id, route)
    with httpx.Client(timeout=60) as c:
        r = c.post(server.url + ROUTES[route], content=content,
                   headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:2000])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert "server_error" not in r.text, r.text[-2000:]
        assert r.text.rstrip().endswith(("data: [DONE]", "}")), r.text[-500:]
    else:
        r.json()


def test_server_is_healthy_and_idle_after_fuzzing(tiny_small_server):
    assert tiny_small_server.healthy()
    wait_for_metrics(tiny_small_server, IDLE)
    m = tiny_small_server.metrics()
    assert not any(k.startswith("ember_http_responses_total") and 'status="5' in k
                   for k in m), [k for k in m if 'status="5' in k]


# ====================================================================== 14. shutdown
def test_sigterm_mid_stream_ends_the_stream_cleanly_and_exits_0(tiny_gguf, e2e_log_dir):
    server = start_server(tiny_gguf, e2e_log_dir, "--graceful-seconds", "2",
                          "--num-kv-blocks", "256")
    try:
        server.wait_ready()
        lines: list[str] = []
        with _long_stream(server, max_tokens=2000) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            lines += [next(it) for _ in range(6)]
            server.proc.send_signal(signal.SIGTERM)
            lines += list(it)  # a truncated chunked body would raise RemoteProtocolError
        data = sse_data(lines)
        assert data[-1] == "[DONE]", data[-3:]
        finish = json.loads(data[-2])["choices"][0]  # the finish chunk, then [DONE]
        assert finish["delta"] == {}
        assert server.proc.wait(15) == 0, server.log()  # (raises past 15 s)
        assert "Traceback" not in server.log(), server.log()
        # the stream was cut at the end of the grace period, not run to its 2000 tokens
        assert finish["finish_reason"] == "abort" and len(data) < 2000
    finally:
        server.stop()


# ====================================================================== 15. metrics
def test_metrics_also_carry_vllms_names(client, model, smol_server):
    """Routers that score replicas by vLLM's metric names read ember's figures under
    them: each vllm: series labelled with the served model name and equal to ember's
    own, the text parsed by prometheus_client (one HELP/TYPE per family)."""
    from prometheus_client.parser import text_string_to_metric_families

    client.chat.completions.create(model=model, messages=user("hi"), max_tokens=3)
    text = httpx.get(smol_server.url + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {KEY_A}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    m = smol_server.metrics()
    label = f'{{model_name="{model}"}}'
    pairs = {"num_requests_running": "ember_requests_running",
             "num_requests_waiting": "ember_requests_waiting",
             "prefix_cache_queries_total": "ember_prefix_cache_queries_total",
             "prefix_cache_hits_total": "ember_prefix_cache_hits_total",
             "num_preemptions_total": "ember_preemptions_total",
             "prompt_tokens_total": "ember_prompt_tokens_total",
             "generation_tokens_total": "ember_generation_tokens_total",
             "time_to_first_token_seconds_count": "ember_time_to_first_token_seconds_count",
             "e2e_request_latency_seconds_count": "ember_e2e_request_latency_seconds_count"}
    for theirs, ours in pairs.items():
        assert m[f"vllm:{theirs}{label}"] == m[ours], theirs
    usage = m["ember_kv_blocks_used"] / m["ember_kv_blocks_total"]
    assert m[f"vllm:kv_cache_usage_perc{label}"] == pytest.approx(usage)
    assert m[f'vllm:request_success_total{{finished_reason="length",model_name="{model}"}}'] \
        == m['ember_request_finished_total{finish_reason="length"}']
    info = families["vllm:lora_requests_info"].samples[0]
    assert info.labels == {"max_lora": "8", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"


# ====================================================================== 15. metrics
def test_metrics_expose_the_ember_series(client, model, smol_server):
    for _ in range(2):  # the second one hits the cache; both finish with "length"
        client.chat.completions.create(model=model, messages=user("hi"), max_tokens=3)
    text = httpx.get(smol_server.url + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {KEY_A}"}).text
    m = smol_server.metrics()
    for name in ("ember_requests_running", "ember_requests_waiting", "ember_kv_blocks_used",
                 "ember_kv_blocks_total", "ember_prefix_cache_queries_total",
                 "ember_prefix_cache_hits_total", "ember_prompt_tokens_total",
                 "ember_generation_tokens_total", "ember_rejected_requests_total"):
        assert name in m, name
        assert f"# TYPE {name} " in text
    assert m["ember_kv_blocks_total"] == 512
    assert m["ember_prompt_tokens_total"] > 0 and m["ember_generation_tokens_total"] > 0
    assert m["ember_prefix_cache_queries_total"] >= m["ember_prefix_cache_hits_total"] > 0
    for reason in ("stop", "length"):
        assert f'ember_request_finished_total{{finish_reason="{reason}"}}' in m
    assert m['ember_request_finished_total{finish_reason="length"}'] > 0
    for h in ("ember_time_to_first_token_seconds", "ember_inter_token_latency_seconds",
              "ember_e2e_request_latency_seconds"):
        assert f"# TYPE {h} histogram" in text
        assert m[f"{h}_count"] > 0 and m[f"{h}_sum"] > 0
        assert m[f'{h}_bucket{{le="+Inf"}}'] == m[f"{h}_count"]
        buckets = [v for k, v in m.items() if k.startswith(f"{h}_bucket")]
        assert buckets == sorted(buckets) and len(buckets) > 5
