"""Every model family behind the real server, unchanged: chat with its template,
streaming, the prefix cache, constrained output (one server per family).

Gemma 3 is the real 270M; Qwen 2, Qwen 3 and Qwen 3 MoE (experts streamed from disk
through a cache smaller than them) are the random-weight GGUFs of tests/test_qwen.py
and tests/test_moe.py (random weights say nothing about quality; the server path, the
cache and the grammar do not care)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from e2e_server import EmberServer, serve_in_process, served_weights

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 16}}}


@pytest.fixture(scope="module", params=["gemma3", "qwen2", "qwen3", "qwen3moe"])
def family_server(request, e2e_log_dir: Path, tiny_qwen_ggufs: dict[str, Path]
                  ) -> Iterator[EmberServer]:
    extra: tuple[str, ...] = ()
    if request.param == "gemma3":
        path = request.getfixturevalue("gemma3_file").path
    elif request.param == "qwen3moe":
        path = request.getfixturevalue("tiny_moe_gguf")
        extra = ("--moe-stream", "--moe-cache-bytes", "300000")  # < the experts' bytes
    else:
        path = tiny_qwen_ggufs[request.param]
    server = serve_in_process(path, e2e_log_dir, "--num-kv-blocks", "256", *extra,
                              weights=served_weights())
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(family_server: EmberServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{family_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_streamed_equals_unstreamed_and_the_prompt_is_cached(family_server, client):
    model = family_server.model_id
    messages = ask("Name three colours of the rainbow, then explain in a few plain words "
                   "why the sky looks blue on a clear afternoon in summer.")
    before = family_server.metrics()
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                           temperature=0)
    after = family_server.metrics()
    prompt = whole.usage.prompt_tokens
    assert prompt > 32 and whole.usage.completion_tokens >= 1
    assert after["ember_prefill_tokens_total"] - before["ember_prefill_tokens_total"] == prompt
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    again = family_server.metrics()
    # the second request found the first one's full prompt blocks in the cache
    hits = again["ember_prefix_cache_hits_total"] - after["ember_prefix_cache_hits_total"]
    assert hits == prompt // 16 * 16 or hits == (prompt - 1) // 16 * 16


def test_json_schema_output_validates(family_server, client):
    r = client.chat.completions.create(
        model=family_server.model_id, messages=ask("Name a city."), max_tokens=40,
        temperature=0.8, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_expert_metrics_are_exported(family_server, client):
    is_moe = "moe" in family_server.model_id  # tiny-moe
    assert any(k.startswith("ember_moe_") for k in family_server.metrics()) == is_moe
    if not is_moe:
        return
    client.completions.create(model=family_server.model_id, prompt="one two three",
                              max_tokens=4)
    lookups = sum(v for k, v in family_server.metrics().items()
                  if k.startswith("ember_moe_expert_lookups_total"))
    assert lookups > 0 and family_server.metrics()["ember_moe_bytes_read_total"] > 0
