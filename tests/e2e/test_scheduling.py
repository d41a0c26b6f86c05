"""SLO-aware scheduling through the server: objectives from flags and from requests,
429s with Retry-After for what would miss, and what /metrics shows."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_server import EmberServer, serve_in_process
from test_server import IDLE, assert_error, user, wait_for_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slo_server(tiny_gguf: Path, e2e_log_dir: Path, tmp_path_factory) -> Iterator[EmberServer]:
    keys = tmp_path_factory.mktemp("slo-keys") / "keys.txt"
    keys.write_text("ka alpha 3\nkb beta\n")
    server = serve_in_process(tiny_gguf, e2e_log_dir, "--api-keys-file", str(keys),
                              "--slo-ttft", "0.4", "--max-num-seqs", "1",
                              "--num-kv-blocks", "256")
    try:
        server.wait_ready(api_key="ka")
        yield server
    finally:
        server.stop()


def _chat(server: EmberServer, **kw) -> dict:
    return {"model": server.model_id, "messages": user("hi"), "max_tokens": 300,
            "ignore_eos": True, **kw}


def test_what_would_miss_its_ttft_gets_429_with_retry_after_and_the_rest_runs(slo_server):
    server = slo_server
    wait_for_metrics(server, IDLE)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(
                c.post(server.url + "/v1/chat/completions", json=_chat(server),
                       headers={"Authorization": f"Bearer {'ka' if i % 2 else 'kb'}"})
                for i in range(12)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses  # one seat: most cannot start in time
    for r in responses:
        if r.status_code == 429:
            err = assert_error(r, 429, None)
            assert err["code"] in ("slo_unattainable", "queue_full")
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["usage"]["completion_tokens"] == 300
    m = wait_for_metrics(server, IDLE)
    assert m["ember_slo_missed_total"] >= statuses.count(429)
    assert m["ember_slo_met_total"] + m["ember_slo_missed_total"] >= 12


def test_a_request_may_bring_its_own_objectives(slo_server):
    server = slo_server
    wait_for_metrics(server, IDLE)
    auth = {"Authorization": "Bearer ka"}
    # a generous objective of its own overrides the server's tight one
    body = _chat(server, max_tokens=5, slo={"ttft_ms": 60000, "tpot_ms": 60000}, priority=-3)
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field,value,param", [
    ("slo", {"ttft_ms": 0}, "slo.ttft_ms"),
    ("slo", {"ttft_ms": 5e-324}, "slo.ttft_ms"),
    ("slo", {"latency": 5}, "slo.latency"),
    ("priority", "high", "priority"),
    ("priority", 10**9, "priority"),
])
def test_bad_scheduling_fields_are_400_naming_them(slo_server, field, value, param):
    r = httpx.post(slo_server.url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": "Bearer ka"},
                   json=_chat(slo_server, **{field: value}))
    assert_error(r, 400, param)


def test_metrics_show_tenants_queue_time_and_objectives(slo_server):
    text = httpx.get(slo_server.url + "/metrics", headers={"Authorization": "Bearer ka"},
                     timeout=10).text
    for name in ("ember_slo_met_total", "ember_slo_missed_total",
                 "ember_tenant_requests_running", "ember_tenant_requests_waiting"):
        assert f"# TYPE {name} " in text
    assert "# TYPE ember_request_queue_time_seconds histogram" in text
    m = slo_server.metrics()
    assert m["ember_request_queue_time_seconds_count"] > 0
