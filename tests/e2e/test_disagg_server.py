"""``ember serve --replicas 2 --prefill-replicas 1`` on Ray Serve: prompts prefilled on
one replica and decoded on the other answer exactly as one engine does; a client that
leaves during the prefill frees both replicas; a prefill replica killed mid-handoff
costs a recompute, not the request.

The server hands every prompt over (``--disagg always``), so each request here takes
the disaggregated path; the decision rule itself is tested in tests/test_disagg.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

from e2e_server import EmberServer, served_weights, start_server  # noqa: E402
from test_server import wait_for_metrics  # noqa: E402

from ember.bench.traffic import text  # noqa: E402
from ember.config import EngineConfig  # noqa: E402
from ember.sampling.params import SamplingParams  # noqa: E402

READY_TIMEOUT = 240.0
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, e2e_log_dir: Path) -> Iterator[EmberServer]:
    s = start_server(smollm2_gguf, e2e_log_dir, "--replicas", "2", "--prefill-replicas", "1",
                     "--disagg", "always", "--num-kv-blocks", "512",
                     weights=served_weights())
    try:
        s.wait_ready(timeout=READY_TIMEOUT)
        wait_for_metrics(s, {"ember_replicas": 2}, timeout=30)
        yield s
    finally:
        s.stop(timeout=30)


@pytest.fixture(scope="module")
def tokenizer(smollm2_file):
    from ember.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_file)


def _prompt(tokenizer, words: int, seed: int) -> list[int]:
    return tokenizer.encode(text(random.Random(seed), words), add_bos=tokenizer.add_bos)


def _oracle(smollm2_gguf: Path, loaded, ids: list[int]) -> tuple[list[int], list[float]]:
    """One engine, one thread (as each replica), computing everything itself."""
    from ember.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(smollm2_gguf), weights=served_weights(),
                                    threads=1, num_kv_blocks=512), loaded=loaded)
    req = engine.add_request(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                 ignore_eos=True, logprobs=0))
    while engine.has_unfinished():
        engine.step()
    return req.token_ids[len(ids):], [lp.logprob for lp in req.logprobs]


def _complete(server: EmberServer, ids: list[int], timeout: float = 120) -> dict:
    body = {"model": server.model_id, "prompt": ids, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _prefill_replica(server: EmberServer) -> tuple[str, int]:
    """The replica allowed to prefill (the first by name, as the planner takes them)."""
    found = sorted(re.fullmatch(r'ember_replica_info\{replica="([^"]+)",pid="(\d+)"\}', n)
                   .groups() for n in server.metrics() if n.startswith("ember_replica_info{"))
    return found[0][0], int(found[0][1])


def _wait_until_prefilling(server: EmberServer, replica: str, timeout: float = 30) -> None:
    name = f'ember_replica_requests_running{{replica="{replica}"}}'
    deadline = time.monotonic() + timeout
    while server.metrics().get(name, 0) < 1:
        assert time.monotonic() < deadline, "the prefill never showed on its replica"
        time.sleep(0.05)


def _handoffs(server: EmberServer) -> dict[str, float]:
    m = server.metrics()
    return {k: m.get(f'ember_disagg_handoffs_total{{result="{k}"}}', 0) for k in ("ok", "failed")}


def test_a_handed_over_prompt_answers_as_one_engine(server, tokenizer, smollm2_gguf,
                                                    smollm2_q4) -> None:
    ids = _prompt(tokenizer, 450, seed=1)
    assert len(ids) > 400
    tokens, logprobs = _oracle(smollm2_gguf, smollm2_q4, ids)
    before = _handoffs(server)
    reply = _complete(server, ids)
    got = reply["choices"][0]
    assert got["text"] == tokenizer.decode(tokens)
    # a new prompt computed for it on the prefill replica: no cache hit in its usage
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert got["logprobs"]["token_logprobs"] == logprobs  # q4: to the bit
    m = server.metrics()
    assert _handoffs(server)["ok"] == before["ok"] + 1  # it did take the handed-over KV
    assert m['ember_disagg_decisions_total{choice="disaggregated"}'] >= 1
    assert m['ember_disagg_observed_seconds_total{term="transfer"}'] > 0
    assert m['ember_router_requests_total{by="prefill"}'] >= 1


def test_a_client_leaving_during_the_prefill_frees_both_replicas(server, tokenizer) -> None:
    replica, _ = _prefill_replica(server)
    ids = _prompt(tokenizer, 1400, seed=2)
    aborts = 'ember_request_finished_total{finish_reason="abort"}'
    before = server.metrics().get(aborts, 0)
    body = {"model": server.model_id, "prompt": ids, "max_tokens": 64, "stream": True}
    # a raw connection: the server answers nothing before the first token, and the
    # client must leave while the prompt is still being prefilled
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload)
                     + payload)
        _wait_until_prefilling(server, replica)
    # the prefill is aborted on its replica and nothing is left on the other
    wait_for_metrics(server, {"ember_kv_blocks_used": 0, "ember_requests_running": 0,
                              "ember_requests_waiting": 0, aborts: before + 1}, timeout=30)
    assert server.healthy()


def test_killing_the_prefill_replica_mid_handoff_recomputes_and_loses_nothing(
        server, tokenizer, smollm2_gguf, smollm2_q4) -> None:
    replica, pid = _prefill_replica(server)
    ids = _prompt(tokenizer, 1400, seed=3)
    assert len(ids) > 1500  # seconds of prefill on one thread: time to kill it
    tokens, logprobs = _oracle(smollm2_gguf, smollm2_q4, ids)
    before = _handoffs(server)
    answer: dict = {}
    sender = threading.Thread(target=lambda: answer.update(_complete(server, ids, 240)))
    sender.start()
    _wait_until_prefilling(server, replica)
    os.kill(pid, signal.SIGKILL)
    sender.join(240)
    got = answer["choices"][0]
    assert got["text"] == tokenizer.decode(tokens)
    assert got["logprobs"]["token_logprobs"] == logprobs
    assert got["finish_reason"] == "length"
    assert _handoffs(server)["failed"] == before["failed"] + 1
    assert server.metrics()["ember_router_replica_failures_total"] >= 1
