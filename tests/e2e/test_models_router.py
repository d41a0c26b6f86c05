"""Several models behind one port (ember/server/models.py), in process: the tiny model
and the real SmolLM2, each loaded on first use, named by a request's ``model``, listed
with their states, unloaded when idle, under a memory budget (never one serving a
request), by the admin routes; a model's answers are the single-model server's."""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path

import httpx
import openai
import pytest
from e2e_server import serve_in_process
from prometheus_client.parser import text_string_to_metric_families

from ember import LLM, SamplingParams

pytestmark = pytest.mark.slow

ADMIN = "sk-admin-router-1234567890"
KEY = "sk-router-tenant-alice-12345"  # tenant "alice" (the fixture's keys file)
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "Name a colour."}]


def _states(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=30, headers=AUTH).json()["data"]
    return {m["id"]: m["status"]["value"] for m in data if m["parent"] is None}


def _wait_state(url: str, name: str, state: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while _states(url)[name] != state:
        assert time.monotonic() < deadline, (_states(url), name, state)
        time.sleep(0.1)


@pytest.fixture(scope="module")
def router(tiny_gguf: Path, smollm2_gguf: Path, e2e_log_dir: Path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("router") / "keys.txt"
    keys.write_text(f"{KEY} alice\n")
    server = serve_in_process(tiny_gguf, e2e_log_dir, "--model", str(smollm2_gguf),
                              "--models-idle", "2", "--num-kv-blocks", "64",
                              "--admin-api-key", ADMIN, "--api-keys-file", str(keys))
    server.wait_ready(api_key=KEY)
    yield server
    server.stop()


def test_models_load_on_first_use_and_answer_as_alone(router, tiny_gguf):
    assert _states(router.url) == {"tiny-llama": "available",
                                   "smollm2-135m": "available"}
    assert httpx.get(f"{router.url}/health", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY)
    reply = client.completions.create(model="tiny-llama", prompt="one two three",
                                      max_tokens=12, temperature=0)
    alone = LLM(str(tiny_gguf), weights="f32", num_kv_blocks=64).generate(
        ["one two three"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert reply.choices[0].text == alone.text
    assert _states(router.url)["tiny-llama"] == "loaded"
    assert _states(router.url)["smollm2-135m"] == "available"
    # the second model by its alias, streamed; Ollama's tag names the same model
    parts = list(client.chat.completions.create(
        model="smollm2-135m", messages=ASK, max_tokens=8, temperature=0,
        stream=True))
    streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    whole = httpx.post(headers=AUTH, url=f"{router.url}/api/chat", timeout=60, json={
        "model": "smollm2-135m:latest", "messages": ASK, "stream": False,
        "options": {"temperature": 0, "num_predict": 8}}).json()
    assert streamed and whole["message"]["content"] == streamed
    assert _states(router.url)["smollm2-135m"] == "loaded"
    tags = httpx.get(f"{router.url}/api/tags", timeout=30, headers=AUTH).json()["models"]
    assert {t["name"] for t in tags} == {"tiny-llama:latest",
                                         "smollm2-135m:latest"}


def test_unknown_models_are_404s_in_each_apis_shape(router):
    openai_404 = httpx.post(f"{router.url}/v1/chat/completions", timeout=30, headers=AUTH,
                            json={"model": "nope", "messages": ASK})
    assert openai_404.status_code == 404
    assert openai_404.json()["error"]["param"] == "model"
    assert "tiny-llama" in openai_404.json()["error"]["message"]
    ollama_404 = httpx.post(headers=AUTH, url=f"{router.url}/api/chat", timeout=30, json={
        "model": "nope", "messages": ASK})
    assert ollama_404.status_code == 404 and "nope" in ollama_404.json()["error"]
    # a body that does not parse reaches the default model's route: its 400
    bad = httpx.post(f"{router.url}/v1/chat/completions", timeout=30, content=b"{",
                     headers={**AUTH, "Content-Type": "application/json"})
    assert bad.status_code == 400


def test_a_tenant_purge_reaches_every_loaded_model(router):
    """DELETE /v1/cache?tenant= forgets the tenant's prefixes in each loaded model (a
    privacy purge must not stop at the default one); the Anthropic SDK's model list."""
    prompt = "one two three four five six seven eight nine ten " * 4
    for model in ("tiny-llama", "smollm2-135m"):
        httpx.post(headers=AUTH, url=f"{router.url}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 1})
    url = f"{router.url}/v1/cache?tenant=alice"
    assert httpx.delete(url, timeout=30).status_code == 401
    purged = httpx.delete(url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
    assert purged.status_code == 200
    counts = {m: r["ram_blocks"] for m, r in purged.json()["models"].items()}
    loaded = {m for m, state in _states(router.url).items() if state == "loaded"}
    assert set(counts) == loaded and all(n > 0 for n in counts.values()), counts
    again = httpx.delete(url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
    assert again.json()["ram_blocks"] == 0
    listed = httpx.get(f"{router.url}/v1/models", timeout=30,
                       headers={**AUTH, "anthropic-version": "2023-06-01"}).json()
    assert [m["id"] for m in listed["data"]] == ["tiny-llama", "smollm2-135m"]
    assert listed["data"][0]["type"] == "model"


def test_metrics_label_each_models_samples(router):
    httpx.post(headers=AUTH, url=f"{router.url}/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": "a", "max_tokens": 2})
    text = httpx.get(headers=AUTH, url=f"{router.url}/metrics", timeout=30).text
    families = list(text_string_to_metric_families(text))  # parses: one HELP per family
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    models = {s.labels.get("model") for f in families for s in f.samples
              if not f.name.startswith(("ember_models_loaded", "ember_router_"))}
    assert "tiny-llama" in models


def _router_counts(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(headers=AUTH, url=f"{url}/metrics", timeout=30).text
    return {(s.labels["route"], s.labels["status"]): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "ember_router_http_responses" for s in f.samples
            if s.name.endswith("_total")}


def test_the_routers_own_refusals_are_counted(router):
    """A 401, a 404 for an unknown model and a 405 that the router answers before any
    model sees the request are in /metrics, by route and status; a made-up path is
    "other", never a series of its own."""
    before = _router_counts(router.url)
    chat = "/v1/chat/completions"
    httpx.post(f"{router.url}{chat}", timeout=30, json={"model": "tiny-llama",
                                                         "messages": ASK})
    httpx.post(f"{router.url}{chat}", timeout=30, headers=AUTH,
               json={"model": "nope", "messages": ASK})
    httpx.post(f"{router.url}/v1/models", timeout=30, headers=AUTH)
    httpx.post(f"{router.url}/made/up/path", timeout=30, json={"model": "nope"})
    after = _router_counts(router.url)
    for key in ((chat, "401"), (chat, "404"), ("/v1/models", "405"), ("other", "401")):
        assert after.get(key, 0) == before.get(key, 0) + 1, (key, after)
    assert not any(route.startswith("/made") for route, _ in after)


def _entry(router, name: str):
    return next(m for m in router.serving.router.models if m.name == name)


def test_idle_models_unload_and_admin_routes(router):
    httpx.post(headers=AUTH, url=f"{router.url}/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": "a", "max_tokens": 2})
    engine = weakref.ref(_entry(router, "tiny-llama").server.thread.engine)
    _wait_state(router.url, "tiny-llama", "available")  # --models-idle 2
    gc.collect()
    assert engine() is None  # the unloaded engine (and its weights) is gone
    load = f"{router.url}/models/load"
    assert httpx.post(load, json={"model": "tiny-llama"}, timeout=30).status_code == 401
    loaded = httpx.post(load, json={"model": "tiny-llama"}, timeout=60,
                        headers={"Authorization": f"Bearer {ADMIN}"})
    assert loaded.json() == {"model": "tiny-llama", "status": "loaded"}
    unloaded = httpx.post(f"{router.url}/models/unload", json={"model": "tiny-llama"},
                          timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
    assert unloaded.json() == {"model": "tiny-llama", "status": "available"}


def test_a_model_whose_engine_stopped_is_a_503_then_loads_again(router):
    complete = {"model": "tiny-llama", "prompt": "a", "max_tokens": 2}
    url = f"{router.url}/v1/completions"
    assert httpx.post(url, json=complete, headers=AUTH, timeout=60).status_code == 200
    _entry(router, "tiny-llama").server.thread.shutdown(timeout=10)  # as if it crashed
    dead = httpx.post(url, json=complete, headers=AUTH, timeout=60)
    assert dead.status_code == 503 and dead.json()["error"]["code"] == "model_load_failed"
    assert httpx.post(url, json=complete, headers=AUTH, timeout=60).status_code == 200
    # the admin key alone reaches a model's admin routes, as on a single-model server
    admin = httpx.post(f"{router.url}/v1/unload_lora_adapter?model=tiny-llama", timeout=30,
                       json={"lora_name": "none"}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 404, admin.text  # the adapter's absence, not a 401
    assert httpx.get(f"{router.url}/api/version", timeout=30).status_code == 200
    assert httpx.post(f"{router.url}/v1/models", headers=AUTH, timeout=30).status_code == 405


def test_a_memory_budget_unloads_the_least_recently_used_idle_model(
        tiny_gguf, smollm2_gguf, e2e_log_dir):
    budget = tiny_gguf.stat().st_size + smollm2_gguf.stat().st_size - 1  # one at a time
    server = serve_in_process(tiny_gguf, e2e_log_dir, "--model", str(smollm2_gguf),
                              "--models-max-bytes", str(budget), "--num-kv-blocks", "64")
    try:
        server.wait_ready()
        smol = "smollm2-135m"

        def complete(model: str, **extra) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": model, "prompt": "one two", "max_tokens": 2, **extra})

        assert complete("tiny-llama").status_code == 200
        assert complete(smol).status_code == 200
        assert _states(server.url) == {"tiny-llama": "available", smol: "loaded"}
        # a model serving a request is never unloaded: loading the other is a 503
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "model": smol, "prompt": "one two", "max_tokens": 1000, "stream": True,
                "ignore_eos": True}) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            busy = complete("tiny-llama")
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "models_busy"
            assert "Retry-After" in busy.headers
        assert complete("tiny-llama").status_code == 200
        assert _states(server.url) == {"tiny-llama": "loaded", smol: "available"}
    finally:
        server.stop()


def test_ollama_keep_alive_0_unloads_the_model(router):
    """Ollama's unload (`ollama stop`): keep_alive 0 with nothing to generate."""
    import ollama

    client = ollama.Client(host=router.url, headers=AUTH, timeout=60)
    client.generate(model="tiny-llama", prompt="a", options={"num_predict": 1})
    assert _states(router.url)["tiny-llama"] == "loaded"
    gone = client.generate(model="tiny-llama", prompt="", keep_alive=0)
    assert gone.done and gone.done_reason == "unload"
    assert _states(router.url)["tiny-llama"] == "available"
    again = client.chat(model="tiny-llama", messages=[], keep_alive=0)  # loads nothing
    assert again.done_reason == "unload" and _states(router.url)["tiny-llama"] == "available"
