"""``ember serve --replicas 2`` on Ray Serve: the single-process server's core cases
run again against it (imported below, with this module's fixtures), then routing and
replica failure.

Each server starts its own private local Ray (loopback, token auth, no dashboard);
two replicas of one thread each.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember.sampling.params import SamplingParams

pytest.importorskip("ray.serve")

from e2e_server import KEY_A, KEY_B, EmberServer, served_weights, start_server  # noqa: E402
from test_server import (  # noqa: E402,F401  (collected here, against the replicas)
    sdk,
    test_burst_beyond_the_queue_gets_429_and_the_server_recovers,
    test_chat_stream_deltas_concatenate_to_the_greedy_reply,
    test_completions_prompt_text_and_token_ids_agree_streamed_or_not,
    test_n2_returns_two_seeded_choices_sharing_one_prompt,
    test_prefix_cache_is_isolated_per_tenant,
    test_requests_without_a_valid_key_get_401,
    test_responses_stream_emits_the_full_event_sequence_in_order,
    test_sdk_raises_authentication_error_on_a_wrong_key,
    test_second_chat_turn_reuses_the_cached_history,
    test_stop_string_is_excluded_and_finishes_with_stop,
    user,
    wait_for_metrics,
)

REPLICA_READY_TIMEOUT = 240.0  # Ray's start, then two replicas loading the model
ADMIN = "sk-admin-0123456789"


def _serve(model: Path, log_dir: Path, *args: str, api_key: str | None = None,
           weights: str = "f32") -> Iterator[EmberServer]:
    server = start_server(model, log_dir, "--replicas", "2", *args, weights=weights)
    try:
        server.wait_ready(timeout=REPLICA_READY_TIMEOUT, api_key=api_key)
        wait_for_metrics(server, {"ember_replicas": 2}, timeout=30)
        yield server
    finally:
        server.stop(timeout=30)


@pytest.fixture(scope="module")
def receiver(otlp_receiver):
    return otlp_receiver


@pytest.fixture(scope="module")
def smol_server(smollm2_gguf: Path, e2e_log_dir: Path, keys_file: Path,
                receiver) -> Iterator[EmberServer]:
    """SmolLM2 on two replicas behind tenants A and B (the same flags as the
    single-process ``smol_server``), exporting traces."""
    yield from _serve(smollm2_gguf, e2e_log_dir, "--api-keys-file", str(keys_file),
                      "--num-kv-blocks", "512", "--admin-api-key", ADMIN,
                      "--otlp-traces-endpoint", receiver.url, api_key=KEY_A,
                      weights=served_weights())


@pytest.fixture(scope="module")
def tiny_adapters(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two random LoRA adapters (GGUF) for the tiny model, visible in its answers."""
    from ember.bench.lora import write_random_adapter
    from ember.models.loader import load_model_meta

    cfg = load_model_meta(str(tiny_gguf), "f32").config
    root = tmp_path_factory.mktemp("tiny-adapters")
    return [write_random_adapter(cfg, 4, seed, root / f"a{seed}.gguf", std=0.3)
            for seed in (1, 2)]


@pytest.fixture(scope="module")
def tiny_mech_server(tiny_gguf: Path, e2e_log_dir: Path,
                     tiny_adapters: list[Path]) -> Iterator[EmberServer]:
    """The tiny model on two replicas, one sequence and a one-slot queue each, with a
    LoRA adapter served from the start and runtime loading allowed."""
    yield from _serve(tiny_gguf, e2e_log_dir, "--max-num-seqs", "1", "--max-queue", "1",
                      "--no-prefix-caching", "--num-kv-blocks", "256",
                      "--lora", f"first={tiny_adapters[0]}", "--admin-api-key", ADMIN)


@pytest.fixture(scope="module")
def client(smol_server: EmberServer):
    return sdk(smol_server)


@pytest.fixture(scope="module")
def model(smol_server: EmberServer) -> str:
    return smol_server.model_id


def _router(server: EmberServer) -> dict[str, float]:
    m = server.metrics()
    return {"affinity": m['ember_router_requests_total{by="affinity"}'],
            "load": m['ember_router_requests_total{by="load"}'],
            "predicted": m["ember_router_predicted_cached_tokens_total"],
            "actual": m["ember_router_actual_cached_tokens_total"]}


def _replicas(server: EmberServer) -> dict[str, int]:
    """replica id -> process id, as the router sees them."""
    out = {}
    for name in server.metrics():
        found = re.fullmatch(r'ember_replica_info\{replica="([^"]+)",pid="(\d+)"\}', name)
        if found:
            out[found[1]] = int(found[2])
    return out


# ====================================================================== metrics
def test_metrics_sum_the_replicas_and_label_each(smol_server, model):
    sdk(smol_server).chat.completions.create(model=model, messages=user("hi"), max_tokens=2)
    m = wait_for_metrics(smol_server, {"ember_replicas": 2})
    assert m["ember_kv_blocks_total"] == 2 * 512  # each replica's --num-kv-blocks
    replicas = _replicas(smol_server)
    assert len(replicas) == 2 and len(set(replicas.values())) == 2
    for rid in replicas:
        assert f'ember_replica_requests_running{{replica="{rid}"}}' in m
        assert f'ember_replica_prefix_cache_hits_total{{replica="{rid}"}}' in m
    assert m['ember_router_requests_total{by="affinity"}'] + m[
        'ember_router_requests_total{by="load"}'] >= 1


# ====================================================================== routing
def test_follow_up_turns_land_where_their_conversation_is_cached(smol_server, model):
    """Six conversations, two turns each: every second turn is routed by affinity and
    finds the first turn's blocks cached; the router predicted what the replica had."""
    client = sdk(smol_server, KEY_A)
    before = _router(smol_server)
    cached = []
    for i in range(6):
        history = user(f"[{uuid.uuid4().hex}] Conversation {i}: name a colour and an animal.")
        first = client.chat.completions.create(model=model, messages=history, max_tokens=8,
                                               temperature=0)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And another one?"}]
        time.sleep(0.1)
        second = client.chat.completions.create(model=model, messages=history, max_tokens=4,
                                                temperature=0)
        cached.append(second.usage.prompt_tokens_details.cached_tokens)
    after = _router(smol_server)
    assert after["affinity"] - before["affinity"] >= 6, (before, after)
    assert all(c >= 16 for c in cached), cached  # at least the first turn's full blocks
    predicted = after["predicted"] - before["predicted"]
    actual = after["actual"] - before["actual"]
    assert predicted > 0 and actual >= 0.9 * predicted, (predicted, actual)


def test_same_text_from_another_tenant_is_not_routed_by_the_first_tenants_cache(
        smol_server, model):
    """B sends A's text: the router predicts for B only what B's own traffic cached
    (at most the chat template's preamble), and that is what B gets; A's repeat is
    predicted and served its whole prefix."""
    text = f"[{uuid.uuid4().hex}] " + "Tenants share nothing, not even a cache line. " * 8
    a, b = sdk(smol_server, KEY_A), sdk(smol_server, KEY_B)
    kw = dict(model=model, messages=user(text), temperature=0, max_tokens=1)
    a.chat.completions.create(**kw)
    time.sleep(0.1)
    before = _router(smol_server)
    r = b.chat.completions.create(**kw)
    mid = _router(smol_server)
    b_cached = r.usage.prompt_tokens_details.cached_tokens
    assert b_cached <= 16 < r.usage.prompt_tokens - 64
    assert mid["predicted"] - before["predicted"] == b_cached == mid["actual"] - before["actual"]
    again = a.chat.completions.create(**kw)
    after = _router(smol_server)
    a_cached = again.usage.prompt_tokens_details.cached_tokens
    assert a_cached >= r.usage.prompt_tokens - 16
    assert after["predicted"] - mid["predicted"] == a_cached == after["actual"] - mid["actual"]
    assert after["affinity"] == mid["affinity"] + 1


def test_an_admin_purge_forgets_a_tenants_prefixes_on_every_replica(smol_server, model):
    """DELETE /v1/cache?tenant=tenant-a reaches both replicas and forgets A's cached
    prompt wherever the router had sent it; B's copy of the same text stays cached."""
    text = f"[{uuid.uuid4().hex}] " + "A purge must reach every replica. " * 8
    a, b = sdk(smol_server, KEY_A), sdk(smol_server, KEY_B)
    kw = dict(model=model, messages=user(text), temperature=0, max_tokens=1)

    def cached(client) -> int:
        return client.chat.completions.create(**kw).usage.prompt_tokens_details.cached_tokens

    for client in (a, a, b, b):
        cached(client)
    r = httpx.delete(f"{smol_server.url}/v1/cache?tenant=tenant-a", timeout=60,
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    assert r.json()["replicas"] == 2 and r.json()["ram_blocks"] >= 4
    assert cached(a) == 0 and cached(b) > 64


def test_a_trace_carries_the_replicas_engine_spans(smol_server, model, receiver):
    """The replica's prefill chunks and decode join the front's trace, under the
    caller's traceparent."""
    trace_id = uuid.uuid4().hex
    r = httpx.post(smol_server.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": user(f"[{trace_id}] Say hi."), "max_tokens": 4},
        headers={"Authorization": f"Bearer {KEY_A}",
                 "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.status_code == 200, r.text
    names = [s.name for s in receiver.trace(bytes.fromhex(trace_id))]
    assert "ember.prefill.chunk" in names and "ember.decode" in names, names


# ====================================================================== exposure
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_the_private_ray_listens_on_loopback_only(smol_server):
    """Every TCP listener of the server's process tree (Ray's GCS, raylet, workers,
    agents: all started by it) is bound to loopback, as ``ss -ltnp`` shows them."""
    import psutil

    root = psutil.Process(smol_server.proc.pid)
    pids = {root.pid} | {p.pid for p in root.children(recursive=True)}
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ours = [line.split() for line in out.splitlines()
            if any(f"pid={pid}," in line for pid in pids)]
    assert len(ours) >= 3, out  # the server's port, Ray's GCS and raylet at least
    exposed = [f"{fields[3]} {fields[-1]}" for fields in ours
               if not fields[3].startswith(("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:"))]
    assert not exposed, exposed


# ====================================================================== LoRA
def test_adapters_on_replicas_answer_as_one_engine_and_load_at_run_time(
        tiny_mech_server, tiny_gguf, tiny_adapters):
    """An adapter from --lora and one loaded through the admin route answer on the
    replicas what one in-process engine answers with them; unloaded, it is a 404."""
    import ember

    server = tiny_mech_server
    llm = ember.LLM(str(tiny_gguf), weights="f32", num_kv_blocks=64, speculation="off",
                    loras={"first": tiny_adapters[0], "second": tiny_adapters[1]})
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def complete(model: str) -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})

    listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert listed["first"]["parent"] == server.model_id and "second" not in listed
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                   headers={"Authorization": f"Bearer {ADMIN}"},
                   json={"lora_name": "second", "lora_path": str(tiny_adapters[1])})
    assert r.status_code == 200, r.text
    answers = {}
    for name in ("first", "second", server.model_id):
        r = complete(name)
        assert r.status_code == 200, r.text
        answers[name] = r.json()["choices"][0]["text"]
    for name in ("first", "second"):
        assert answers[name] == llm.generate(["Once upon a time"], greedy, lora=name)[0].text
    assert len(set(answers.values())) == 3
    r = httpx.post(server.url + "/v1/unload_lora_adapter", timeout=60,
                   headers={"Authorization": f"Bearer {ADMIN}"}, json={"lora_name": "second"})
    assert r.status_code == 200, r.text
    r = complete("second")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ====================================================================== failures
def _stream(server: EmberServer, max_tokens: int) -> httpx.Response:
    body = {"model": server.model_id, "messages": user("hello"), "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60)


def test_disconnect_mid_stream_aborts_on_the_replica(tiny_mech_server):
    server = tiny_mech_server
    aborts = 'ember_request_finished_total{finish_reason="abort"}'
    before = server.metrics()[aborts]
    with _stream(server, 1500) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert sum(1 for line in (next(lines) for _ in range(8)) if line.startswith("data:"))
        wait_for_metrics(server, {"ember_requests_running": 1}, timeout=10)
    idle = {"ember_kv_blocks_used": 0, "ember_requests_running": 0,
            "ember_requests_waiting": 0, aborts: before + 1}
    wait_for_metrics(server, idle, timeout=15)
    assert server.healthy()


def test_a_replica_killed_mid_stream_ends_the_stream_cleanly_and_service_resumes(
        tiny_mech_server):
    server = tiny_mech_server
    wait_for_metrics(server, {"ember_replicas": 2}, timeout=60)
    pids = _replicas(server)
    chunks: list[str] = []
    with _stream(server, 1500) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        chunks += [next(lines) for _ in range(6)]
        m = server.metrics()
        busy = [rid for rid in pids if m.get(f'ember_replica_inflight{{replica="{rid}"}}')]
        assert len(busy) == 1, m
        os.kill(pids[busy[0]], signal.SIGKILL)
        chunks += list(lines)  # the stream must end, not hang
    data = [c[len("data: "):] for c in chunks if c.startswith("data: ")]
    assert data[-1] == "[DONE]" or '"error"' in data[-1], data[-3:]
    assert any('"error"' in d and "died" in d for d in data), data[-3:]
    # service resumes at once on the other replica...
    body = {"model": server.model_id, "prompt": "hi", "max_tokens": 4}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    # ...and Ray Serve brings a replacement up
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = _replicas(server)
        if len(now) == 2 and set(now.values()) != set(pids.values()):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no replacement replica: {_replicas(server)}")
    assert server.metrics()["ember_router_replica_failures_total"] >= 1
    for _ in range(4):  # one at a time: each replica has a one-slot queue
        assert httpx.post(server.url + "/v1/completions", json=body,
                          timeout=60).status_code == 200
