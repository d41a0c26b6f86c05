"""The goodput benchmark: its statistics on synthetic traces, its traffic, and its load
generator against a stub endpoint that replays fixed timings (the stub tests the
measuring tool, not ember)."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.bench.goodput import Objectives, percentile, summarize
from ember.bench.loadgen import Endpoint, RequestRecord, RunResult, run
from ember.bench.traffic import SYSTEM_PROMPT, Workload, arrivals


# ---------------------------------------------------------------- statistics
def rec(sent: float, ttft: float | None, tokens: int = 5, tpot: float = 0.05,
        status: str = "ok", tenant: int = 0) -> RequestRecord:
    r = RequestRecord(scheduled=sent, sent=sent, tenant=tenant, kind="chat", status=status)
    if status == "ok" and ttft is not None:
        r.first_token = sent + ttft
        r.chunk_times = [r.first_token + tpot * (i + 1) for i in range(tokens - 1)]
        r.end = r.chunk_times[-1] if r.chunk_times else r.first_token
        r.output_tokens = tokens
    else:
        r.end = sent + 0.01
    return r


def test_goodput_counts_requests_meeting_both_objectives_over_the_run():
    slo = Objectives(ttft=1.0, tpot=0.1)
    records = [
        rec(0.0, 0.5),                      # good
        rec(1.0, 1.5),                      # late first token
        rec(2.0, 0.2, tpot=0.2),            # slow tokens
        rec(3.0, 0.3, tenant=1),            # good
        rec(4.0, None, status="rejected", tenant=1),
        rec(5.0, None, status="failed", tenant=1),
        rec(6.0, 0.9, tokens=1, tenant=1),  # one token: no TPOT, good
    ]
    result = RunResult(records, started=0.0, duration=10.0, planned=7)
    s = summarize(result, slo)
    assert (s["sent"], s["completed"], s["rejected"], s["failed"], s["good"]) == (7, 5, 1, 1, 3)
    assert s["goodput_rps"] == pytest.approx(0.3) and s["throughput_rps"] == pytest.approx(0.5)
    assert s["attainment"] == pytest.approx(3 / 7)
    assert s["per_tenant"][0]["attainment"] == pytest.approx(1 / 3)
    assert s["per_tenant"][1]["attainment"] == pytest.approx(2 / 4)
    assert s["ttft_s"]["median"] == pytest.approx(0.5)
    # ok replies of more than one token: TPOTs 0.05, 0.05, 0.2, 0.05 -> p99 interpolates
    assert s["tpot_s"]["p99"] == pytest.approx(0.05 + 0.15 * 0.97)
    assert s["offered_rps"] == pytest.approx(1.0)
    assert s["output_tps"] == pytest.approx((5 * 4 + 1) / 10)


def test_prefix_hit_rate_and_follow_up_ttft_count_only_what_they_say():
    records = [rec(0.0, 0.9), rec(1.0, 0.2), rec(2.0, 0.4), rec(3.0, None, status="failed")]
    for r, turn, prompt, cached in zip(records, (0, 1, 2, 1), (100, 150, 200, 900),
                                       (0, 96, 144, 900), strict=True):
        r.turn, r.prompt_tokens, r.cached_tokens = turn, prompt, cached
    s = summarize(RunResult(records, started=0.0, duration=5.0, planned=4), Objectives())
    assert s["prefix_hit_rate"] == pytest.approx((96 + 144) / (100 + 150 + 200))  # ok only
    assert s["ttft_follow_up_s"]["median"] == pytest.approx(0.3)  # turns 1 and 2
    assert s["ttft_s"]["median"] == pytest.approx(0.4)


def test_percentiles_interpolate_like_numpy():
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    import numpy as np

    for q in (0.0, 0.25, 0.5, 0.9, 0.99, 1.0):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q * 100)))
    assert percentile([], 0.5) is None


@pytest.mark.parametrize("text,ttft,tpot", [("ttft=2000,tpot=150", 2.0, 0.15),
                                            ("tpot=50", None, 0.05), ("", None, None)])
def test_objectives_parse_milliseconds(text, ttft, tpot):
    assert Objectives.parse(text) == Objectives(ttft, tpot)


@pytest.mark.parametrize("text", ["latency=5", "ttft=fast", "ttft=-1"])
def test_bad_objectives_name_the_problem(text):
    with pytest.raises(ValueError, match="--slo"):
        Objectives.parse(text)


# ---------------------------------------------------------------- traffic
def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_burstiness():
    for burstiness, cv2 in ((1.0, 1.0), (0.25, 4.0)):
        times = arrivals(4.0, 20001, burstiness, seed=3)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.25, rel=0.03)
        assert statistics.pvariance(gaps) / mean**2 == pytest.approx(cv2, rel=0.1)
    assert arrivals(2.0, 50, seed=9) == arrivals(2.0, 50, seed=9)


def test_chat_follow_ups_resend_the_conversation_with_the_servers_replies():
    w = Workload("chat", tenants=4, seed=1, follow_up=1.0)
    first = w.next()
    body = w.body(first)
    assert body["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert body["max_tokens"] == 48 and body["ignore_eos"] and body["stream"]
    w.finish(first, "A reply from the server.")
    again = w.next()
    assert again is first  # follow_up=1: the idle conversation continues
    follow = w.body(again)["messages"]
    assert follow[:3] == body["messages"] + [{"role": "assistant",
                                              "content": "A reply from the server."}]
    assert follow[3]["role"] == "user"
    others = [w.next() for _ in range(4)]  # `again` is busy: new conversations
    assert [c.tenant for c in [first, *others]] == [0, 1, 2, 3, 0]


def test_workloads_are_deterministic_for_a_seed():
    def bodies(seed: int) -> list[dict]:
        w = Workload("mix", tenants=2, seed=seed, follow_up=0.0)  # new conversations only
        out = []
        for _ in range(8):
            conv = w.next()
            out.append(w.body(conv))
            w.finish(conv, "ok")
        return out

    assert bodies(5) == bodies(5) and bodies(5) != bodies(6)
    kinds = {"docqa": 0, "json": 0}
    for b in bodies(5):
        if "response_format" in b:
            kinds["json"] += 1
        elif "Question:" in b["messages"][-1]["content"]:
            kinds["docqa"] += 1
    assert kinds == {"docqa": 2, "json": 2}


# ---------------------------------------------------------------- the load generator
TTFT, GAP, TOKENS = 0.20, 0.05, 5
RECEIVED: list[dict] = []  # the chat requests' bodies, in arrival order
BUSY_UNTIL = [0.0]  # the stub answers the bench's one-token probe slowly until then
PROBES: list[float] = []  # when each probe arrived
# per streamed request, in arrival order: when its body had arrived and when each chunk
# was sent (time.monotonic(): the stub runs in this process)
SENT: list[tuple[float, list[float]]] = []


async def _stub(scope, receive, send) -> None:
    """An OpenAI chat endpoint with fixed timings: 429 for tenant key k-429, 500 for
    k-500, a stream that stalls for k-slow, else TTFT then TOKENS chunks GAP apart."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    auth = dict(scope["headers"]).get(b"authorization", b"").decode()
    if scope["path"] == "/v1/models":
        await _respond(send, 200, b'{"data":[{"id":"stub"}]}')
        return
    if auth.endswith("k-429"):
        await _respond(send, 429, b'{"error":{}}', [(b"retry-after", b"3")])
        return
    if auth.endswith("k-500"):
        await _respond(send, 500, b'{"error":{}}')
        return
    request = json.loads(body)
    if request.get("max_tokens") == 1:  # the bench's probe: slow while "busy"
        PROBES.append(time.monotonic())
        await asyncio.sleep(1.0 if time.monotonic() < BUSY_UNTIL[0] else 0.0)
        await _respond(send, 200, b'{"choices":[]}')
        return
    RECEIVED.append(request)
    sent: list[float] = []
    SENT.append((time.monotonic(), sent))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    await asyncio.sleep(60 if auth.endswith("k-slow") else TTFT)
    for i in range(TOKENS):
        if i:
            await asyncio.sleep(GAP)
        chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n"
                    .encode(), "more_body": True})
        sent.append(time.monotonic())
    usage = {"choices": [], "usage": {"completion_tokens": TOKENS, "prompt_tokens": 100,
                                      "prompt_tokens_details": {"cached_tokens": 40}}}
    await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\n"
                "data: [DONE]\n\n".encode(), "more_body": False})


async def _respond(send, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_stub, host="127.0.0.1", port=port,
                                           log_level="error", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_load_generator_measures_the_stubs_fixed_timings(stub_url):
    """What the client measures against what the stub did, as the stub's own clock saw
    it (on a busy machine its sleeps run long, and the client's figures with them): the
    first token no sooner than the stub's wait, and no later than it was sent plus the
    delivery; the time per output token that of the stub's chunks, within delivery."""
    ep = Endpoint(stub_url, "stub", ["k-ok"])
    SENT.clear()
    result = asyncio.run(run(ep, Workload("chat", 1), [0.0, 0.1, 0.2], timeout=10))
    assert [r.status for r in result.records] == ["ok"] * 3
    assert len(SENT) == 3
    for r, (arrived, sent) in zip(result.records, SENT, strict=True):
        assert r.output_tokens == TOKENS == len(sent)
        assert (r.prompt_tokens, r.cached_tokens) == (100, 40)
        stub_ttft = sent[0] - arrived  # at least TTFT: its sleep
        stub_tpot = (sent[-1] - sent[0]) / (TOKENS - 1)  # at least GAP
        # (the event loop may wake a sleep a clock tick early)
        assert TTFT - 0.005 <= stub_ttft <= r.ttft < stub_ttft + 0.1
        # the first token's own delivery lag shortens the span it starts
        assert 0.9 * stub_tpot <= r.tpot < stub_tpot + 0.03
        assert len(r.itls) == TOKENS - 1
    assert result.records[2].sent == pytest.approx(0.2, abs=0.05)  # sent on schedule


def test_refusals_failures_and_timeouts_are_recorded_as_such(stub_url):
    ep = Endpoint(stub_url, "stub", ["k-429", "k-500", "k-slow"])
    result = asyncio.run(run(ep, Workload("docqa", 3), [0.0, 0.0, 0.0], timeout=1.0))
    by_tenant = {r.tenant: r for r in result.records}
    assert by_tenant[0].status == "rejected" and by_tenant[0].retry_after == "3"
    assert by_tenant[1].status == "failed" and by_tenant[1].http_status == 500
    assert by_tenant[2].status == "timeout"
    assert summarize(result, Objectives(ttft=5.0)).get("good") == 0


def test_closed_loop_keeps_the_asked_number_of_requests_in_flight(stub_url):
    ep = Endpoint(stub_url, "stub", ["k-ok"])
    result = asyncio.run(run(ep, Workload("short-long", 1), concurrency=3, num_requests=9,
                             timeout=10))
    assert len(result.records) == 9
    sends = sorted(r.sent for r in result.records)
    assert sends[2] < 0.05 and sends[3] > TTFT  # three at once, then as each one ends


def test_bench_serve_writes_its_table_json_and_plots(stub_url, tmp_path: Path, capsys):
    pytest.importorskip("matplotlib")
    from ember.cli import main

    out = tmp_path / "serve.json"
    RECEIVED.clear()
    code = main(["bench", "serve", "--url", stub_url, "--api-keys", "k-ok",
                 "--rates", "4,8", "--num-requests", "6", "--warmup", "1",
                 "--out", str(out), "--plot", str(tmp_path / "p")])
    assert code == 0
    text = capsys.readouterr().out
    assert "goodput" in text and "4/s" in text and "8/s" in text
    doc = json.loads(out.read_text())
    assert [s["rate"] for s in doc["steps"]] == [4.0, 8.0]
    assert all(s["good"] == 6 for s in doc["steps"])
    # each step sends prompts of its own: the last step's would be prefix-cache hits
    prompts = [b["messages"][-1]["content"] for b in RECEIVED]
    assert len(prompts) == 13 and not set(prompts[1:7]) & set(prompts[7:])
    for name in ("goodput", "latency", "tenants"):
        assert (tmp_path / f"p-{name}.png").stat().st_size > 1000


def test_the_next_step_waits_until_the_endpoint_has_finished_the_last_ones_work(stub_url):
    """A server still working after a step (what its clients gave up on) would run on
    the cores the next step measures: the bench probes it with a one-token request
    until it answers about as fast as when idle."""
    from ember.bench.serve import _probe, _settle

    ep = Endpoint(stub_url, "stub", ["k-ok"])
    idle = _probe(ep, 10)
    assert idle is not None and idle < 0.5
    BUSY_UNTIL[0] = time.monotonic() + 2.0
    PROBES.clear()
    waited = _settle(ep, idle, 10)
    assert waited >= 1.5 and time.monotonic() >= BUSY_UNTIL[0]
    # it stopped at the first probe that found the stub idle
    assert sum(t >= BUSY_UNTIL[0] for t in PROBES) == 1 and len(PROBES) >= 2
    PROBES.clear()
    _settle(ep, idle, 10)
    assert len(PROBES) == 1  # idle now: one probe


def test_an_over_saturated_step_stops_sending_and_says_so(stub_url):
    """A server that never answers: once a fifth of the requests sent (at least 8) have
    waited three TTFT objectives for a first token, the trace is cut short."""
    ep = Endpoint(stub_url, "stub", ["k-slow"])
    times = arrivals(20.0, 60, seed=1)
    result = asyncio.run(run(ep, Workload("docqa", 1), times, timeout=2.0, slo_ttft=0.1))
    assert result.saturated and 8 <= len(result.records) < 40 and result.planned == 60
    assert all(r.status == "timeout" for r in result.records)


def test_longdoc_sends_new_two_thousand_token_documents_between_long_answer_streams(
        smollm2_file):
    from ember.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_file)
    w = Workload("longdoc", tenants=2, seed=3, follow_up=0.0)
    bodies = []
    for _ in range(6):
        conv = w.next()
        bodies.append(w.body(conv))
        w.finish(conv, "ok")
    docs, streams = bodies[0::2], bodies[1::2]
    assert all(b["max_tokens"] == 256 and b["ignore_eos"] for b in streams)
    prompts = [b["messages"][-1]["content"] for b in docs]
    assert len(set(prompts)) == 3  # each document is new: nothing for the prefix cache
    # what makes it the long-prompt case: ~2,000 tokens each, within SmolLM2's context
    assert all(1800 <= len(tok.encode(p)) <= 2300 for p in prompts)
    assert all(b["max_tokens"] == 64 for b in docs)
