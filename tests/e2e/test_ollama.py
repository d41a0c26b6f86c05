"""Ollama's API through the official ``ollama`` Python client (and LangChain's
``ChatOllama``) against the real SmolLM2 (the shared ``smol_server``) and a tiny
thinking template: chat and generate streamed and whole, the model routes, ``format``
with a pydantic schema, tools, thinking, and errors in Ollama's shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from e2e_server import KEY_A, EmberServer
from pydantic import BaseModel, ConfigDict, Field
from test_tools import WEATHER

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol_server: EmberServer) -> ollama.Client:
    return ollama.Client(host=smol_server.url, headers={"Authorization": f"Bearer {KEY_A}"},
                         timeout=120)


def test_chat_whole_and_streamed_answer_as_the_openai_route_does(client, smol_server):
    whole = client.chat(model=smol_server.model_id, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    chat = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=KEY_A).chat.completions.create(
        model=smol_server.model_id, messages=ASK, max_tokens=24, temperature=0)
    assert whole.message.content == chat.choices[0].message.content
    assert whole.prompt_eval_count == chat.usage.prompt_tokens
    assert whole.eval_count == chat.usage.completion_tokens
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration
    assert whole.prompt_eval_duration > 0 and whole.eval_duration > 0
    parts = list(client.chat(model=smol_server.model_id, messages=ASK, options=GREEDY,
                             stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    assert parts[-1].done_reason == whole.done_reason


def test_generate_applies_the_template_unless_raw(client, smol_server):
    whole = client.generate(model=smol_server.model_id, prompt=ASK[0]["content"],
                            options=GREEDY)
    chat = client.chat(model=smol_server.model_id, messages=ASK, options=GREEDY)
    assert whole.response == chat.message.content
    streamed = list(client.generate(model=smol_server.model_id, prompt=ASK[0]["content"],
                                    options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == whole.response and streamed[-1].done
    raw = client.generate(model=smol_server.model_id, prompt="The capital of France is",
                          raw=True, options={"temperature": 0, "num_predict": 4})
    completion = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=KEY_A).completions \
        .create(model=smol_server.model_id, prompt="The capital of France is", max_tokens=4,
                temperature=0)
    assert raw.response == completion.choices[0].text
    system = client.generate(model=smol_server.model_id, prompt="hi", system="Be brief.",
                             options={"temperature": 0, "num_predict": 1})
    as_chat = client.chat(model=smol_server.model_id, options={"num_predict": 1},
                          messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hi"}])
    assert system.prompt_eval_count == as_chat.prompt_eval_count
    loaded = client.generate(model=smol_server.model_id, prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    unloaded = client.generate(model=smol_server.model_id, prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload"


def test_stop_seed_and_num_predict_are_honoured(client, smol_server):
    capped = client.chat(model=smol_server.model_id, messages=ASK,
                         options={"temperature": 0, "num_predict": 3})
    assert capped.eval_count == 3 and capped.done_reason == "length"
    kw = dict(model=smol_server.model_id, messages=ASK,
              options={"temperature": 1.0, "seed": 11, "num_predict": 16})
    assert client.chat(**kw).message.content == client.chat(**kw).message.content
    text = client.chat(model=smol_server.model_id, messages=ASK, options=GREEDY).message.content
    stop = text.split()[2]
    cut = client.chat(model=smol_server.model_id, messages=ASK,
                      options={**GREEDY, "stop": [stop]})
    assert cut.message.content == text[:text.index(stop)] and cut.done_reason == "stop"


def test_model_routes_describe_the_served_model(client, smol_server):
    listed = client.list().models
    assert [m.model for m in listed] == [f"{smol_server.model_id}:latest"]
    entry = listed[0]
    assert entry.size > 50_000_000 and entry.details.format == "gguf"
    assert entry.details.family == "llama" and entry.details.parameter_size == "134.5M"
    shown = client.show(smol_server.model_id)
    assert shown.modelinfo["llama.context_length"] > 0
    assert shown.modelinfo["general.architecture"] == "llama"
    assert "<|im_start|>" in shown.template and "completion" in shown.capabilities
    assert client.show(f"{smol_server.model_id}:latest").modelinfo == shown.modelinfo
    running = client.ps().models
    assert [m.model for m in running] == [f"{smol_server.model_id}:latest"]
    version = httpx.get(f"{smol_server.url}/api/version", timeout=10).json()["version"]
    assert version.count(".") == 2


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no room for keys of the model's own
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int


def test_format_with_a_pydantic_schema_constrains_the_reply(client, smol_server):
    r = client.chat(model=smol_server.model_id, format=City.model_json_schema(),
                    messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                    options={"temperature": 0.7, "seed": 3, "num_predict": 200})
    City.model_validate_json(r.message.content)
    j = client.generate(model=smol_server.model_id, format="json",
                        prompt='Reply with a JSON object whose key "answer" holds 2+2.',
                        options={"temperature": 0, "num_predict": 100})
    assert isinstance(json.loads(j.response), dict)


# Ollama's API has no tool_choice: whether a reply calls is the model's choice. A
# history in which the assistant answered such questions with calls makes the 135M
# model call again (greedy); its calls are grammar-built either way.
HISTORY = [
    {"role": "user", "content": "What's the weather in Berlin?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}}]},
    {"role": "tool", "content": "12 degrees", "tool_name": "get_weather"},
    {"role": "assistant", "content": "It is 12 degrees in Berlin."},
    {"role": "user", "content": "What's the weather in Madrid?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "get_weather", "arguments": {"city": "Madrid", "unit": "celsius"}}}]},
    {"role": "tool", "content": "25 degrees", "tool_name": "get_weather"},
    {"role": "assistant", "content": "It is 25 degrees in Madrid."},
    {"role": "user", "content": "What's the weather in Paris?"}]


def test_a_tool_call_comes_back_in_ollamas_shape_and_its_result_goes_back(client,
                                                                          smol_server):
    r = client.chat(model=smol_server.model_id, tools=[WEATHER], messages=HISTORY,
                    options={"temperature": 0, "num_predict": 80})
    assert r.message.tool_calls and r.message.content == "", r.message
    for call in r.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = list(client.chat(model=smol_server.model_id, tools=[WEATHER],
                                messages=HISTORY, stream=True,
                                options={"temperature": 0, "num_predict": 80}))
    calls = [c for p in streamed for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        (c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls]
    history = [*HISTORY, r.message, {"role": "tool", "content": "18 degrees",
                                     "tool_name": "get_weather"}]
    after = client.chat(model=smol_server.model_id, messages=history, tools=[WEATHER],
                        options={"temperature": 0, "num_predict": 8})
    assert after.prompt_eval_count > r.prompt_eval_count  # the call and result rendered
    # Ollama's newer clients send the call's id back, and the result's tool_call_id
    raw = _post(smol_server, "/api/chat", {"model": smol_server.model_id, "stream": False,
                                            "messages": HISTORY, "tools": [WEATHER],
                                            "options": {"temperature": 0, "num_predict": 80}})
    message = raw.json()["message"]
    call = message["tool_calls"][0]
    assert call["id"].startswith("call_") and call["function"]["index"] == 0
    bare = {**message, "tool_calls": [{"function": {k: v for k, v in c["function"].items()
                                                    if k != "index"}}
                                      for c in message["tool_calls"]]}

    def prompt(history: list[dict]) -> int:
        r = _post(smol_server, "/api/chat", {"model": smol_server.model_id, "stream": False,
                                              "messages": history, "tools": [WEATHER],
                                              "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text
        return r.json()["prompt_eval_count"]

    # ids (or none: the result answers the call before it) render SmolLM2's prompt alike
    assert prompt([*HISTORY, message, {"role": "tool", "content": "18",
                                       "tool_call_id": call["id"]}]) \
        == prompt([*HISTORY, bare, {"role": "tool", "content": "18"}]) > r.prompt_eval_count


def test_a_reply_offered_tools_is_text_or_valid_calls(client, smol_server):
    for seed, q in enumerate(["Say hello.", "Weather in Oslo in celsius, please."]):
        r = client.chat(model=smol_server.model_id, tools=[WEATHER],
                        messages=[{"role": "user", "content": q}],
                        options={"temperature": 0.9, "seed": seed, "num_predict": 80})
        if r.message.tool_calls:
            for call in r.message.tool_calls:
                jsonschema.validate(dict(call.function.arguments),
                                    WEATHER["function"]["parameters"])
        else:
            assert r.message.content and not r.message.content.startswith("<")


def test_langchains_chat_ollama_makes_a_tool_call(smol_server):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city.

        Args:
            city: the city
            unit: celsius or fahrenheit
        """
        return "18"

    llm = langchain_ollama.ChatOllama(
        model=smol_server.model_id, base_url=smol_server.url, temperature=0, num_predict=80,
        client_kwargs={"headers": {"Authorization": f"Bearer {KEY_A}"}})
    messages = []
    for k, m in enumerate(HISTORY):
        if m["role"] == "user":
            messages.append(HumanMessage(m["content"]))
        elif m["role"] == "tool":
            messages.append(ToolMessage(m["content"], tool_call_id=f"call{k - 1}"))
        elif m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            messages.append(AIMessage("", tool_calls=[{"name": fn["name"], "id": f"call{k}",
                                                       "args": fn["arguments"]}]))
        else:
            messages.append(AIMessage(m["content"]))
    reply = llm.bind_tools([get_weather]).invoke(messages)
    assert reply.tool_calls, reply
    for call in reply.tool_calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], WEATHER["function"]["parameters"])


def _post(server: EmberServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY_A}"})


@pytest.mark.parametrize("route,body,status,named", [
    ("/api/chat", {"model": "nope", "messages": ASK}, 404, "nope"),
    ("/api/chat", {"messages": ASK, "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ("/api/chat", {"messages": ASK, "options": {"temperature": -1}}, 400, "temperature"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
     400, "messages[0].images"),
    ("/api/chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("/api/chat", {"messages": ASK, "think": True}, 400, "think"),
    ("/api/chat", {"messages": ASK, "format": "yaml"}, 400, "format"),
    ("/api/generate", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/api/generate", {"prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/show", {"model": ""}, 400, "model"),
    ("/api/chat", {"messages": ASK, "options": {"num_predict": "4"}}, 400,
     "options.num_predict"),
    ("/api/chat", {"messages": ASK, "options": {"stop": 5}}, 400, "options.stop"),
    ("/api/chat", {"messages": [{"role": "user", "content": 0}]}, 400, "messages[0].content"),
    ("/api/chat", {"messages": [{"role": "tool", "content": "r", "tool_name": 5}]}, 400,
     "messages[0].tool_name"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x " * 9000}]}, 400,
     "leaves no room"),
])
def test_bad_requests_get_ollamas_error_shape(smol_server, route, body, status, named):
    base = {"model": smol_server.model_id} | ({} if route == "/api/show" else {"stream": False})
    r = _post(smol_server, route, {**base, **body})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and named in r.json()["error"], r.json()


def test_the_client_raises_ollamas_errors(client, smol_server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=ASK)
    assert e.value.status_code == 404
    bad = ollama.Client(host=smol_server.url, headers={"Authorization": "Bearer sk-wrong"})
    with pytest.raises(ollama.ResponseError) as e:
        bad.list()
    assert e.value.status_code == 401


# ---------------------------------------------------------------------- thinking


def test_thinking_comes_back_beside_the_content(thinking_server):
    client = ollama.Client(host=thinking_server.url)
    kw = dict(model=thinking_server.model_id, messages=[{"role": "user", "content": "hi"}],
              options={"temperature": 0, "num_predict": 40})
    low = client.chat(think="low", **kw)
    assert low.message.thinking and "</think>" not in low.message.thinking
    assert "<think>" not in low.message.content
    parts = list(client.chat(think="low", stream=True, **kw))
    assert "".join(p.message.thinking or "" for p in parts).strip() == low.message.thinking
    assert "".join(p.message.content for p in parts) == low.message.content
    off = client.chat(think=False, **kw)
    assert not off.message.thinking
    assert "thinking" in client.show(thinking_server.model_id).capabilities
