"""LoRA adapters through ``ember serve``, driven by the official ``openai`` client.

The real SmolLM2 with the PEFT adapter served as ``peft`` (``--lora``) for every
tenant; the GGUF one loaded at run time for tenant A only, through the admin API. A
request picks an adapter with ``"model"``; what it answers is what the in-process
engine answers with the same adapter (the engine is tested against transformers +
PEFT in tests/test_lora.py). An adapter another tenant may not use is the same 404 as
one that does not exist; unloading lets running requests finish.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import _serve
from e2e_server import KEY_A, KEY_B, EmberServer
from test_server import assert_error

from ember.sampling.params import SamplingParams
from ember.server.metrics import tenant_hash

pytestmark = pytest.mark.slow
ADMIN = "sk-admin-0123456789"


KEY_Q = "sk-tenant-q-5555555555"  # a tenant allowed nothing in the queue


@pytest.fixture(scope="module")
def lora_server(smollm2_gguf: Path, e2e_log_dir: Path, keys_file: Path,
                smollm2_adapters, tmp_path_factory, smollm2_llm) -> Iterator[EmberServer]:
    root = tmp_path_factory.mktemp("lora-server")
    keys = root / "keys.txt"
    keys.write_text(keys_file.read_text() + f"{KEY_Q} tenant-q\n")
    limits = root / "limits.txt"
    limits.write_text("tenant-q max_queued=0\ntenant-b kv_share=0.0625\n"
                      "* max_running=4 max_queued=64\n")
    yield from _serve(smollm2_gguf, e2e_log_dir, "--api-keys-file", str(keys),
                      "--tenant-limits", str(limits),
                      "--lora", f"peft={smollm2_adapters['peft']}",
                      "--admin-api-key", ADMIN, "--num-kv-blocks", "256", api_key=KEY_A,
                      loaded=smollm2_llm.engine.loaded)


def _client(server: EmberServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def _admin(server: EmberServer, route: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def _complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    return r.choices[0].text


def test_an_adapter_answers_as_the_engine_does_with_it(lora_server, smollm2_gguf,
                                                       smollm2_adapters) -> None:
    import ember

    llm = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=64,
                    loras={"peft": smollm2_adapters["peft"]})
    greedy = SamplingParams(temperature=0, max_tokens=10)
    prompts = ["The capital of France is", "Once upon a time"]
    client = _client(lora_server, KEY_A)
    base = lora_server.model_id
    with ThreadPoolExecutor(4) as pool:  # base and adapter requests in the same steps
        got = list(pool.map(lambda mp: _complete(client, *mp),
                            [(m, p) for m in (base, "peft") for p in prompts]))
    want = [o.text for lr in (None, "peft") for o in llm.generate(prompts, greedy, lora=lr)]
    assert got == want
    assert got[:2] != got[2:]  # the adapter changes the answers
    metrics = httpx.get(f"{lora_server.url}/metrics", timeout=10,
                        headers={"Authorization": f"Bearer {KEY_A}"}).text
    counts = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
              for line in metrics.splitlines() if line.startswith("ember_lora_")}
    assert counts['ember_lora_requests_total{adapter="peft"}'] >= 2
    assert counts["ember_lora_resident"] >= 1


def test_models_lists_what_the_tenant_may_use_and_admin_loads_for_one_tenant(
        lora_server, smollm2_adapters) -> None:
    a, b = _client(lora_server, KEY_A), _client(lora_server, KEY_B)
    base = lora_server.model_id
    listed = {m.id: m for m in a.models.list().data}
    assert listed["peft"].parent == base and listed[base].parent is None
    # no admin key, a wrong one: refused
    body = {"lora_name": "gguf", "lora_path": str(smollm2_adapters["gguf"]),
            "tenants": ["tenant-a"]}
    assert _admin(lora_server, "load_lora_adapter", body, key=KEY_A).status_code == 401
    bad = _admin(lora_server, "load_lora_adapter", {**body, "lora_path": "/no/such"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    ok = _admin(lora_server, "load_lora_adapter", body)
    assert ok.status_code == 200 and ok.json()["rank"] == 4
    assert "gguf" in {m.id for m in a.models.list().data}
    assert "gguf" not in {m.id for m in b.models.list().data}
    assert _complete(a, "gguf", "Once upon a time") == _complete(a, "peft", "Once upon a time")
    # another tenant's adapter and a missing one: the same 404
    for name in ("gguf", "nope"):
        with pytest.raises(openai.NotFoundError) as e:
            _complete(b, name, "Hi")
        assert e.value.body["code"] == "model_not_found"
        assert name in e.value.body["message"]


def test_hostile_adapter_paths_are_400s_in_bounded_time_while_chats_run(
        lora_server, tmp_path) -> None:
    """/dev/zero (never ends) and a FIFO (blocks its open), loaded twice at once while a
    chat completion runs: each load is a 400 naming lora_path within the client's 30 s,
    the chat answers; a relative path is refused (it would resolve against the server's
    working directory); a file that is not a GGUF is refused without its content."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    client = _client(lora_server, KEY_A)

    def load(path: str) -> httpx.Response:
        return httpx.post(f"{lora_server.url}/v1/load_lora_adapter", timeout=30,
                          json={"lora_name": "x", "lora_path": path},
                          headers={"Authorization": f"Bearer {ADMIN}"})

    with ThreadPoolExecutor(5) as pool:
        loads = [pool.submit(load, p) for p in ("/dev/zero", str(fifo)) * 2]
        chat = pool.submit(_complete, client, lora_server.model_id, "Once upon a time")
        for r in (f.result() for f in loads):
            assert_error(r, 400, "lora_path")
            assert "not a regular file" in r.json()["error"]["message"]
        assert isinstance(chat.result(timeout=60), str)
    assert_error(load("adapters/x.gguf"), 400, "lora_path")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2:x:0:0\n")
    r = load(str(secret))
    assert_error(r, 400, "lora_path")
    assert "hunter2" not in r.text


def test_unloading_lets_running_requests_finish(lora_server, smollm2_gguf,
                                                smollm2_adapters) -> None:
    """The adapter is unloaded while a request with it is still running on the server
    (its metrics say so after the unload returned): the request runs to its end with
    the adapter — the in-process engine's text with it — and new requests get 404."""
    import ember

    client = _client(lora_server, KEY_A)
    body = {"lora_name": "temp", "lora_path": str(smollm2_adapters["peft"])}
    assert _admin(lora_server, "load_lora_adapter", body).status_code == 200
    prompt, n = "Count: 1, 2, 3,", 64
    stream = client.completions.create(model="temp", prompt=prompt, max_tokens=n,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # it is running
    assert _admin(lora_server, "unload_lora_adapter",
                  {"lora_name": "temp"}).status_code == 200
    assert lora_server.metrics()["ember_requests_running"] == 1  # unloaded mid-request
    rest = list(chunks)
    text += "".join(c.choices[0].text for c in rest if c.choices)
    usage = [c.usage for c in rest if c.usage is not None]
    assert usage and usage[-1].completion_tokens == n
    llm = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=64,
                    loras={"peft": smollm2_adapters["peft"]})
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    assert text == llm.generate([prompt], greedy, lora="peft")[0].text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "temp", "Hi")
    assert _admin(lora_server, "unload_lora_adapter",
                  {"lora_name": "temp"}).status_code == 404


def test_admin_purges_one_tenants_cached_prefixes(lora_server) -> None:
    """DELETE /v1/cache?tenant=tenant-a (admin key): tenant A's next identical request
    finds nothing cached, tenant B's still does; the route refuses without the admin
    key (401) or without a tenant (400)."""
    prompt = "A long shared preamble about the weather in several cities. " * 4
    clients = {"tenant-a": _client(lora_server, KEY_A), "tenant-b": _client(lora_server, KEY_B)}

    def cached(tenant: str) -> int:
        r = clients[tenant].completions.create(model=lora_server.model_id, prompt=prompt,
                                               max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    for tenant in clients:
        cached(tenant)
        assert cached(tenant) > 0  # the second time, its own copy is cached

    def purge(query: str, key: str = ADMIN) -> httpx.Response:
        return httpx.delete(f"{lora_server.url}/v1/cache{query}", timeout=60,
                            headers={"Authorization": f"Bearer {key}"})

    assert purge("?tenant=tenant-a", KEY_A).status_code == 401
    assert purge("").status_code == 400
    r = purge("?tenant=tenant-a")
    assert r.status_code == 200, r.text
    assert r.json()["tenant"] == "tenant-a" and r.json()["ram_blocks"] > 0
    assert cached("tenant-a") == 0 and cached("tenant-b") > 0
    # metrics name tenants by hash only
    metrics = lora_server.metrics()
    assert not any("tenant-a" in name or "tenant-b" in name for name in metrics)
    assert metrics[f'ember_tenant_cached_blocks{{tenant="{tenant_hash("tenant-b")}"}}'] > 0


def test_a_request_beyond_its_tenants_kv_share_is_a_400_naming_the_limit(lora_server) -> None:
    """tenant-b may hold 1/16 of the 256-block pool (16 blocks, 256 tokens)."""
    r = httpx.post(f"{lora_server.url}/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY_B}"},
                   json={"model": lora_server.model_id, "prompt": "Hi", "max_tokens": 300})
    assert_error(r, 400, "max_tokens")
    assert "kv_share=0.0625" in r.json()["error"]["message"]
    with httpx.stream("POST", f"{lora_server.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY_B}"},
                      json={"model": lora_server.model_id, "prompt": "Hi", "max_tokens": 200,
                            "stream": True}) as ok:  # within the share: it runs (we leave)
        assert ok.status_code == 200
        assert next(line for line in ok.iter_lines() if line.startswith("data:"))


def test_a_tenant_over_its_queue_limit_gets_a_429_naming_its_own_limit(lora_server) -> None:
    r = httpx.post(f"{lora_server.url}/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY_Q}"},
                   json={"model": lora_server.model_id, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["code"] == "tenant_queue_full"
    assert "tenant 'tenant-q'" in error["message"] and "max_queued=0" in error["message"]
    assert "tenant-a" not in error["message"] and "tenant-b" not in error["message"]
    ok = _complete(_client(lora_server, KEY_A), lora_server.model_id, "Hi")
    assert isinstance(ok, str)  # other tenants are served
