"""What client libraries send without being asked: the multi-turn pattern of the
OpenAI SDK (append the returned message, call again), null or empty standard fields,
``"include": []`` on responses. Lenient on the standard, strict on the unknown."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from e2e_server import EmberServer

pytestmark = pytest.mark.slow


def sdk(server: EmberServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def post(server: EmberServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)


def test_a_returned_chat_message_goes_back_in_as_the_sdk_sends_it(tiny_small_server):
    client, model = sdk(tiny_small_server), tiny_small_server.model_id
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    for turn in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                               seed=turn)
        message = reply.choices[0].message
        assert message.refusal is None
        messages += [message, {"role": "user", "content": "and?"}]  # the SDK's own object
    # the same message as JSON with every standard field present, null or empty
    returned = reply.choices[0].message.model_dump()
    returned.update(refusal=None, annotations=[], audio=None, function_call=None,
                    tool_calls=None)
    r = post(tiny_small_server, "chat/completions", {
        "model": model, "max_tokens": 2, "messages": [messages[0], returned],
        "store": False, "metadata": {"run": "1"}, "service_tier": "auto",
        "parallel_tool_calls": True, "prompt_cache_key": "k", "safety_identifier": "u1",
        "reasoning_effort": None, "prediction": None, "stream_options": None})
    assert r.status_code == 200, r.text


def test_a_refusal_is_what_the_assistant_said(tiny_small_server):
    body = {"model": tiny_small_server.model_id, "max_tokens": 1, "seed": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    said = {"role": "assistant", "content": "I can't help with that."}
    refused = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    replies = [post(tiny_small_server, "chat/completions",
                    {**body, "messages": [*body["messages"], m,
                                          {"role": "user", "content": "why?"}]})
               for m in (said, refused)]
    assert [r.status_code for r in replies] == [200, 200], replies[1].text
    assert replies[0].json()["usage"]["prompt_tokens"] == \
        replies[1].json()["usage"]["prompt_tokens"]


def test_responses_accept_what_the_agents_sdk_sends(tiny_small_server):
    r = post(tiny_small_server, "responses", {
        "model": tiny_small_server.model_id, "input": "hi", "max_output_tokens": 2,
        "include": [], "store": False, "truncation": "disabled", "parallel_tool_calls": False,
        "top_logprobs": None, "metadata": {}, "background": False, "service_tier": None,
        "stream_options": None, "prompt_cache_key": None})
    assert r.status_code == 200, r.text
    item = r.json()["output"][0]
    again = post(tiny_small_server, "responses", {  # the returned item, sent back
        "model": tiny_small_server.model_id, "max_output_tokens": 2,
        "input": [{"role": "user", "content": "hi"}, item,
                  {"role": "user", "content": "and?"}]})
    assert again.status_code == 200, again.text


@pytest.mark.parametrize("route,field,value", [
    ("chat/completions", "store", True),
    ("chat/completions", "service_tier", "flex"),
    ("chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("chat/completions", "verbosity", "low"),
    ("responses", "include", ["reasoning.encrypted_content"]),
    ("responses", "truncation", "auto"),
    ("responses", "background", True),
    ("responses", "prompt", {"id": "pmpt_1"}),
])
def test_standard_fields_asking_for_what_ember_cannot_do_are_refused_by_name(
        tiny_small_server, route, field, value):
    body: dict[str, Any] = {"model": tiny_small_server.model_id, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat")
                else {"input": "hi"})
    r = post(tiny_small_server, route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split("[")[0] == field


@pytest.mark.parametrize("field,value", [("audio", {"id": "a1"}),
                                         ("function_call", {"name": "f", "arguments": "{}"})])
def test_message_fields_with_content_ember_cannot_use_are_refused_by_name(
        tiny_small_server, field, value):
    r = post(tiny_small_server, "chat/completions", {
        "model": tiny_small_server.model_id,
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "x", field: value}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[1].{field}"


# ---------------------------------------------------------------------- tokenizer routes
def _auth() -> dict[str, str]:
    from e2e_server import KEY_A

    return {"Authorization": f"Bearer {KEY_A}"}


def test_tokenize_gives_llama_cpps_ids_and_detokenize_the_text_back(smol_server):
    import json
    from pathlib import Path

    golden = json.loads((Path(__file__).parents[1] / "golden" / "smollm2_tokens.json")
                        .read_text())
    for case in golden["cases"][:12]:
        r = httpx.post(f"{smol_server.url}/tokenize", headers=_auth(), timeout=30,
                       json={"model": smol_server.model_id, "prompt": case["text"],
                             "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == case["ids"], case["text"]
        assert body["count"] == len(case["ids"]) and body["max_model_len"] > 0
        assert "".join(body["token_strs"]) == case["text"] or "\ufffd" in "".join(
            body["token_strs"])
        back = httpx.post(f"{smol_server.url}/detokenize", headers=_auth(), timeout=30,
                          json={"tokens": case["ids"]})
        assert back.status_code == 200 and back.json() == {"prompt": case["text"]}


def test_tokenize_messages_counts_what_a_chat_completion_computes(smol_server):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    r = httpx.post(f"{smol_server.url}/tokenize", headers=_auth(), timeout=30,
                   json={"messages": messages})
    chat = httpx.post(f"{smol_server.url}/v1/chat/completions", headers=_auth(), timeout=60,
                      json={"model": smol_server.model_id, "messages": messages,
                            "max_tokens": 1})
    assert r.status_code == 200 and chat.status_code == 200
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    info = httpx.get(f"{smol_server.url}/tokenizer_info", headers=_auth(), timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert info["vocab_size"] == 49152 and info["model_max_length"] > 0
    # without its generation prompt the rendered chat is shorter
    bare = httpx.post(f"{smol_server.url}/tokenize", headers=_auth(), timeout=30,
                      json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == r.json()["tokens"][:bare["count"]] < r.json()["tokens"]


@pytest.mark.parametrize("route,body,param", [
    ("detokenize", {"tokens": [1, 2, 10**9]}, "tokens[2]"),
    ("detokenize", {"tokens": "abc"}, "tokens"),
    ("tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("tokenize", {}, "messages"),
    ("tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("tokenize", {"messages": [{"role": "user", "content": "b"}],
                  "add_special_tokens": True}, "add_special_tokens"),
])
def test_bad_tokenizer_requests_are_400_naming_the_field(smol_server, route, body, param):
    r = httpx.post(f"{smol_server.url}/{route}", headers=_auth(), json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_routes_need_the_api_key(smol_server):
    r = httpx.post(f"{smol_server.url}/tokenize", json={"prompt": "a"}, timeout=30)
    assert r.status_code == 401


# ---------------------------------------------------------------------- echo
def test_echo_logprobs_are_the_teacher_forced_logprobs_of_the_model(smol_server, smol_reference):
    import torch

    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = smol_reference.encode(text)
    kv_dtype = smol_reference.engine.config.kv_dtype  # the server's too: both the default
    logprobs = torch.log_softmax(
        smol_reference.engine.loaded.model.score(ids, kv_dtype=kv_dtype).float(), -1)
    want = [None] + [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    for max_tokens in (0, 3):
        r = httpx.post(f"{smol_server.url}/v1/completions", headers=_auth(), timeout=60,
                       json={"model": smol_server.model_id, "prompt": text, "echo": True,
                             "logprobs": 2, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"].startswith(text)
        lp = choice["logprobs"]
        n = len(ids)
        assert len(lp["tokens"]) == n + max_tokens
        assert "".join(lp["tokens"][:n]) == text
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:n] == pytest.approx(want[1:], abs=1e-3)
        assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"])
        if max_tokens:
            assert lp["text_offset"][n] == len(text)
            assert choice["text"] == text + "".join(lp["tokens"][n:])
        else:
            assert choice["text"] == text and choice["finish_reason"] == "length"


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "stream": True}, "echo"),
])
def test_echo_misuse_is_400_naming_the_field(smol_server, body, param):
    r = httpx.post(f"{smol_server.url}/v1/completions", headers=_auth(), timeout=30,
                   json={"model": smol_server.model_id, "prompt": "hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------- reasoning


def test_reasoning_is_split_from_the_answer_and_budgeted(thinking_server):
    client = sdk(thinking_server)
    kw = dict(model=thinking_server.model_id, messages=[{"role": "user", "content": "hi"}],
              max_tokens=40, temperature=1.0, seed=1, extra_body={"thinking_token_budget": 8,
                                                        "ignore_eos": True})
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message.model_dump()
    assert message["reasoning_content"] is not None and "<think>" not in message["content"]
    assert "</think>" not in message["content"] + message["reasoning_content"]
    assert r.usage.completion_tokens == 40  # forced tag included (the tiny model's answer
    # is whitespace; tests/test_reasoning.py checks the answer on the real model)
    thought, said = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            thought += delta.get("reasoning_content") or ""
            said += delta.get("content") or ""
    assert (thought.strip(), said) == (message["reasoning_content"], message["content"])
    none = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True},
                                             "reasoning_effort": "none"})
    assert none.choices[0].message.model_dump()["reasoning_content"] == ""


@pytest.mark.parametrize("body,param", [({"thinking_token_budget": 5}, "thinking_token_budget"),
                                        ({"reasoning_effort": "high"}, "reasoning_effort"),
                                        ({"reasoning_effort": "lots"}, "reasoning_effort")])
def test_reasoning_options_need_a_thinking_template(tiny_small_server, body, param):
    r = post(tiny_small_server, "chat/completions", {
        "model": tiny_small_server.model_id, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_return_a_reasoning_item_then_the_answer(thinking_server):
    client = sdk(thinking_server)
    kw = dict(model=thinking_server.model_id, input="hi", max_output_tokens=30,
              temperature=1.0, reasoning={"effort": "minimal"}, extra_body={"seed": 2})
    r = client.responses.create(**kw)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"], kinds
    events = list(client.responses.create(stream=True, **kw))
    done = events[-1].response
    assert [item.type for item in done.output] == kinds
    assert done.output[0].content[0].text == r.output[0].content[0].text
    assert "</think>" not in r.output[1].content[0].text
