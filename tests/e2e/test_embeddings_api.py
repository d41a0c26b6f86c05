"""``POST /v1/embeddings`` through the official ``openai`` client and ``/api/embed``
through the ``ollama`` client, against the real SmolLM2 (the shared ``smol_server``);
``POST /v1/rerank`` against a converted Qwen3 reranker. The oracles are ``LLM.embed``
and ``LLM.rerank`` on the same files, themselves checked against transformers
(tests/test_embeddings.py)."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch
from e2e_server import KEY_A, EmberServer, serve_in_process

pytestmark = pytest.mark.slow

TEXTS = ["The lighthouse stood at the edge of the cliff.", "Paris is the capital of France.",
         "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def client(smol_server: EmberServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=KEY_A)


@pytest.fixture(scope="module")
def expected(smol_reference) -> list[torch.Tensor]:
    return smol_reference.embed(TEXTS)


def _refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


def test_openai_embeddings_are_the_models_in_either_encoding(client, smol_server, expected,
                                                             smol_reference):
    floats = client.embeddings.create(model=smol_server.model_id, input=TEXTS,
                                      encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    for d, v in zip(floats.data, expected, strict=True):
        assert len(d.embedding) == 576  # SmolLM2-135M's hidden size
        assert torch.allclose(torch.tensor(d.embedding), v, atol=1e-6)
        assert abs(float(np.linalg.norm(d.embedding)) - 1) < 1e-5
    tokens = sum(len(smol_reference.encode(t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # the client's default asks for base64 and decodes it as float32: the same numbers
    packed = client.embeddings.create(model=smol_server.model_id, input=TEXTS)
    assert [d.embedding for d in packed.data] == [d.embedding for d in floats.data]
    raw = httpx.post(f"{smol_server.url}/v1/embeddings", timeout=60, json={
        "model": smol_server.model_id, "input": TEXTS[0], "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {KEY_A}"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    assert decoded.tolist() == floats.data[0].embedding


def test_token_ids_and_dimensions(client, smol_server, expected, smol_reference):
    ids = [smol_reference.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=smol_server.model_id, input=ids,
                                      encoding_format="float")
    for d, v in zip(by_ids.data, expected[:2], strict=True):
        assert torch.allclose(torch.tensor(d.embedding), v, atol=1e-6)
    one = client.embeddings.create(model=smol_server.model_id, input=ids[0],
                                   encoding_format="float")
    assert one.data[0].embedding == by_ids.data[0].embedding
    short = client.embeddings.create(model=smol_server.model_id, input=TEXTS[0],
                                     dimensions=64, encoding_format="float")
    want = torch.nn.functional.normalize(expected[0][:64], dim=0)
    assert len(short.data[0].embedding) == 64
    assert torch.allclose(torch.tensor(short.data[0].embedding), want, atol=1e-6)


def test_bad_input_is_a_400_naming_it(client, smol_server, smol_reference):
    model = smol_server.model_id
    assert _refused(lambda: client.embeddings.create(model=model, input=""))[
        "param"] == "input"
    assert _refused(lambda: client.embeddings.create(model=model, input=[]))[
        "param"] == "input"
    assert _refused(lambda: client.embeddings.create(model=model, input=["ok", [1, 10**9]]))[
        "param"] == "input[1]"
    too_long = "word " * 9000  # past the 8192-token window
    body = _refused(lambda: client.embeddings.create(model=model, input=too_long))
    assert body["code"] == "context_length_exceeded" and body["param"] == "input"
    assert _refused(lambda: client.embeddings.create(model=model, input="x", dimensions=4096))[
        "param"] == "dimensions"
    assert _refused(lambda: client.embeddings.create(
        model=model, input="x", encoding_format="int8"))["param"] == "encoding_format"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="wrong").embeddings.create(
            model=model, input="x")
    # the server still embeds afterwards
    assert client.embeddings.create(model=model, input="x").data


def test_ollama_embed(smol_server, expected):
    client = ollama.Client(host=smol_server.url, headers={"Authorization": f"Bearer {KEY_A}"},
                           timeout=120)
    got = client.embed(model=smol_server.model_id, input=TEXTS)
    assert len(got.embeddings) == 3
    for e, v in zip(got.embeddings, expected, strict=True):
        assert torch.allclose(torch.tensor(e), v, atol=1e-6)
    assert got.prompt_eval_count > 0 and got.total_duration > 0
    single = client.embed(model=smol_server.model_id, input=TEXTS[1], dimensions=32)
    assert torch.allclose(torch.tensor(single.embeddings[0]),
                          torch.nn.functional.normalize(expected[1][:32], dim=0), atol=1e-6)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=smol_server.model_id, input="word " * 9000, truncate=False)
    assert e.value.status_code == 400 and "input" in e.value.error


def test_ollama_truncates_to_the_window_by_default(tiny_small_server):
    """A 64-token window: an input past it embeds as its first 64 tokens (Ollama's
    default ``truncate``); OpenAI's route refuses it instead."""
    client = ollama.Client(host=tiny_small_server.url, timeout=120)
    long = "one two three four five six seven eight nine ten " * 20
    ids = httpx.post(f"{tiny_small_server.url}/tokenize", timeout=60, json={
        "model": tiny_small_server.model_id, "prompt": long}).json()["tokens"]
    assert len(ids) > 64
    cut = openai.OpenAI(base_url=f"{tiny_small_server.url}/v1", api_key="x").embeddings.create(
        model=tiny_small_server.model_id, input=ids[:64], encoding_format="float")
    got = client.embed(model=tiny_small_server.model_id, input=long)
    assert got.embeddings[0] == cut.data[0].embedding
    assert got.prompt_eval_count == 64


def test_rerank_orders_documents_by_the_models_scores(qwen3_reranker, e2e_log_dir,
                                                     smol_server):
    path = qwen3_reranker[0]
    server = serve_in_process(path, e2e_log_dir, "--num-kv-blocks", "64")
    try:
        server.wait_ready()
        from ember import LLM

        query, docs = "What is the capital of France?", TEXTS + ["Berlin is in Germany."]
        want = LLM(str(path), weights="f32", num_kv_blocks=64).rerank(query, docs)

        def rerank(**body) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/rerank", timeout=60,
                              json={"model": server.model_id, "query": query, **body})

        got = rerank(documents=docs, top_n=3, return_documents=True).json()
        order = sorted(range(len(docs)), key=lambda i: -want[i])[:3]
        assert [r["index"] for r in got["results"]] == order
        for r in got["results"]:
            assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4
            assert r["document"]["text"] == docs[r["index"]]
        assert got["usage"]["prompt_tokens"] > 0
        jina = httpx.post(f"{server.url}/rerank", timeout=60, json={
            "query": query, "documents": [{"text": d} for d in docs]}).json()
        assert len(jina["results"]) == len(docs) and "document" not in jina["results"][0]
        for body, param in (({"documents": []}, "documents"), ({"documents": ["a"],
                            "top_n": 0}, "top_n"), ({"documents": ["a"], "rank": 1}, "rank")):
            refused = rerank(**body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        embed = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                           json={"model": server.model_id, "input": "x"})
        assert embed.status_code == 400 and "reranker" in embed.json()["error"]["message"]
    finally:
        server.stop()
    # a chat model has no head to score with: a 400 naming the model
    refused = httpx.post(f"{smol_server.url}/v1/rerank", timeout=60, headers={
        "Authorization": f"Bearer {KEY_A}"}, json={"query": "q", "documents": ["d"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_the_embed_benchs_timing_counts_what_the_server_answers(smol_server):
    """ember bench embed's measurement against a live server: positive rates, one per
    batch size, each request answered with as many vectors as it sent (the bench's own
    check); its memory probe of the switch bench reads this process's tree."""
    import os

    from ember.bench import embed, switch

    batches = {n: embed._inputs(49152, n, 8, seed=n) for n in (1, 3)}
    assert all(len(ids) == 8 and min(ids) >= 300 for b in batches.values() for ids in b)
    rates = embed._time(smol_server.url, smol_server.model_id, batches, reps=1,
                        headers={"Authorization": f"Bearer {KEY_A}"})
    assert set(rates) == {1, 3} and all(r > 0 for r in rates.values())
    assert switch._tree_rss(os.getpid()) > 50_000_000


def test_a_bert_encoder_is_served_for_embeddings_only(bert_files, e2e_log_dir):
    from ember import LLM

    path = bert_files[1]["mean"]
    server = serve_in_process(path, e2e_log_dir, "--num-kv-blocks", "16")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        got = client.embeddings.create(model=server.model_id, input=TEXTS,
                                       encoding_format="float")
        want = LLM(str(path), weights="f32", num_kv_blocks=16).embed(TEXTS)
        for d, v in zip(got.data, want, strict=True):
            assert len(d.embedding) == 64
            assert torch.allclose(torch.tensor(d.embedding), v, atol=1e-5)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=server.model_id, prompt="hi", max_tokens=2)
        assert e.value.body["param"] == "model" and "embedding model" in e.value.body["message"]
    finally:
        server.stop()


def test_an_embedding_request_whose_client_leaves_is_dropped(smol_server):
    """A client that gives up on a long batch: the server notices (a client disconnect
    in its metrics, the request dropped before its next pass) and serves the next one."""
    import re

    def disconnects() -> float:
        text = httpx.get(f"{smol_server.url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {KEY_A}"}).text
        return float(re.search(r"^ember_client_disconnects_total (\S+)$", text, re.M)[1])

    before = disconnects()
    body = {"model": smol_server.model_id, "encoding_format": "float",
            "input": [[300 + (i * 7 + j) % 9000 for i in range(200)] for j in range(64)]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{smol_server.url}/v1/embeddings", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {KEY_A}"})
    deadline = time.monotonic() + 30
    while disconnects() < before + 1:
        assert time.monotonic() < deadline, "the disconnect was never noticed"
        time.sleep(0.1)
    again = httpx.post(f"{smol_server.url}/v1/embeddings", timeout=60,
                       headers={"Authorization": f"Bearer {KEY_A}"},
                       json={"model": smol_server.model_id, "input": "still here"})
    assert again.status_code == 200
