"""Anthropic's Messages API through the official ``anthropic`` SDK against the real
SmolLM2 (the shared ``smol_server``) and a tiny thinking template: plain and system
turns answer what the OpenAI route answers for the same conversation; streamed text
equals the whole reply; a two-step tool loop; count_tokens; thinking blocks; stop
sequences; errors in Anthropic's shape; an agent's long system prompt served from the
prefix cache on its second turn."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from e2e_server import KEY_A, KEY_B, EmberServer
from test_server import wait_for_metrics

pytestmark = pytest.mark.slow

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 40},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Add two integers.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "integer"}},
                        "required": ["a", "b"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, ADD)}
SYSTEM = "You are a terse assistant. Answer in one short sentence."
# the 2.x SDK no longer has sampling arguments; ember still honours them from the body
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(smol_server: EmberServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smol_server.url, api_key=KEY_A, max_retries=0,
                               timeout=120)


def _openai(server: EmberServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0,
                         timeout=120)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_turn_with_a_system_prompt_answers_as_the_openai_route_does(client, smol_server):
    question = "What is the capital of France?"
    m = client.messages.create(model=smol_server.model_id, max_tokens=24, extra_body=GREEDY,
                               system=SYSTEM, messages=[{"role": "user", "content": question}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    chat = _openai(smol_server).chat.completions.create(
        model=smol_server.model_id, max_tokens=24, extra_body=GREEDY,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    assert _text(m) == chat.choices[0].message.content and _text(m)
    assert m.usage.output_tokens == chat.usage.completion_tokens
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert prompt == chat.usage.prompt_tokens
    assert m.usage.cache_creation_input_tokens == 0
    # the same conversation as blocks: the same prompt
    blocks = client.messages.create(
        model=smol_server.model_id, max_tokens=24, extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": question}]}])
    assert _text(blocks) == _text(m)
    assert blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens == prompt


def test_streamed_deltas_assemble_the_whole_reply_in_anthropics_event_order(client,
                                                                             smol_server):
    kw = dict(model=smol_server.model_id, max_tokens=32, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Tell me about the sea."}])
    whole = client.messages.create(**kw)
    kinds, text = [], ""
    with client.messages.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                assert event.delta.type == "text_delta" and event.index == 0
                text += event.delta.text
        final = stream.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]  # the SDK's own convenience events
    # (the SDK drops pings: test_a_long_stream_reaches_message_stop reads the raw stream)
    assert raw[:2] == ["message_start", "content_block_start"], raw
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"], raw
    assert set(raw[2:-3]) == {"content_block_delta"}, raw
    assert text == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_two_step_tool_loop(client, smol_server):
    """``any`` gets calls valid against their schema (stop_reason tool_use); the results
    go back as tool_result blocks and the model answers in text; a named tool with
    parallel use off is exactly one call to it."""
    question = {"role": "user", "content": "What's the weather in Paris, and what is 2+40?"}
    first = client.messages.create(model=smol_server.model_id, max_tokens=120,
                                   extra_body=GREEDY, tools=[WEATHER, ADD],
                                   tool_choice={"type": "any"}, messages=[question])
    # parallel calls allowed: SmolLM2 may go on calling until max_tokens cuts the last
    # call short (dropped; stop_reason says max_tokens), else it ends on tool_use
    assert first.stop_reason in ("tool_use", "max_tokens")
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and all(b.id.startswith("toolu_") for b in uses)
    for b in uses:
        jsonschema.validate(b.input, SCHEMAS[b.name])
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "42"} for b in uses]
    results[0]["is_error"] = True
    history = [question, {"role": "assistant", "content": first.content},
               {"role": "user", "content": results}]
    final = client.messages.create(model=smol_server.model_id, max_tokens=20, extra_body=GREEDY,
                                   tools=[WEATHER, ADD], tool_choice={"type": "none"},
                                   messages=history)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"]
    counted = client.messages.count_tokens(model=smol_server.model_id, tools=[WEATHER, ADD],
                                           tool_choice={"type": "none"}, messages=history)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens \
        == counted.input_tokens
    # the calls and results are in the prompt as SmolLM2 (no tools in its template) gets
    # them: Hermes calls in the assistant's turn, each result in a user turn
    calls = "\n".join("<tool_call>" + json.dumps({"name": b.name, "arguments": b.input},
                                                  ensure_ascii=False) + "</tool_call>"
                      for b in uses)
    rendered = [question, {"role": "assistant", "content": calls}] + [
        {"role": "user", "content": f"<tool_response>\n{'Error: ' if k == 0 else ''}42\n"
                                    "</tool_response>"} for k in range(len(uses))]
    tokenized = httpx.post(f"{smol_server.url}/tokenize", timeout=30, json={
        "messages": rendered}, headers={"Authorization": f"Bearer {KEY_A}"}).json()
    assert counted.input_tokens == tokenized["count"]
    one = client.messages.create(
        model=smol_server.model_id, max_tokens=80, extra_body={"temperature": 0.9},
        tools=[WEATHER, ADD],
        tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Add 3 and 4."}])
    assert [(b.type, b.name) for b in one.content] == [("tool_use", "add")]
    jsonschema.validate(one.content[0].input, SCHEMAS["add"])


def test_a_call_cut_short_by_max_tokens_is_stop_reason_max_tokens(client, smol_server):
    """A required call that does not fit: no error and no partial call syntax as text,
    but Anthropic's ``stop_reason: max_tokens``, whole and streamed."""
    kw = dict(model=smol_server.model_id, max_tokens=6, extra_body=GREEDY, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Oslo?"}])
    whole = client.messages.create(**kw)
    assert (whole.stop_reason, whole.content) == ("max_tokens", [])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.content) == ("max_tokens", [])


def test_a_streamed_tool_call_is_the_whole_calls_input(client, smol_server):
    kw = dict(model=smol_server.model_id, max_tokens=80, extra_body=GREEDY, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather",
                           "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Weather in Oslo?"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input)
                                                          for b in whole.content]


def test_count_tokens_is_what_the_prompt_renders_to(client, smol_server):
    messages = [{"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "How are you?"}]
    counted = client.messages.count_tokens(model=smol_server.model_id, system=SYSTEM,
                                           messages=messages)
    tokenized = httpx.post(f"{smol_server.url}/tokenize",
                           headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30,
                           json={"messages": [{"role": "system", "content": SYSTEM},
                                              *messages]}).json()
    assert counted.input_tokens == tokenized["count"] > 10


def test_stop_sequences_end_the_reply_and_say_which(client, smol_server):
    kw = dict(model=smol_server.model_id, max_tokens=40, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Describe a forest in detail."}])
    text = _text(client.messages.create(**kw))
    words = text.split()
    assert len(words) > 6, text
    stop = " " + words[4]
    cut = client.messages.create(stop_sequences=["\u2603never", stop], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[:text.index(stop)]
    with client.messages.stream(stop_sequences=[stop], **kw) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, _text(streamed)) == (
        "stop_sequence", stop, _text(cut))


def test_errors_come_in_anthropics_shape(client, smol_server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=smol_server.model_id, max_tokens=None,  # type: ignore
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and "max_tokens" in e.value.message
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    bad = anthropic.Anthropic(base_url=smol_server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=smol_server.model_id, max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonexistent", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("body,named", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": 9000}}, "thinking.budget_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"temperature": 1.5}, "temperature"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
])
def test_bad_bodies_are_400s_naming_the_field(smol_server, body, named):
    r = httpx.post(f"{smol_server.url}/v1/messages", timeout=30,
                   headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
                   json={"model": smol_server.model_id, "max_tokens": 100,
                         "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert named in err["error"]["message"], err


def test_both_key_headers_name_the_same_tenant_and_requests_are_counted(smol_server):
    """A key in x-api-key and the same key as a bearer token are one tenant: the second
    sees the first's cached prefix, another tenant's key does not."""
    body = {"model": smol_server.model_id, "max_tokens": 2, "temperature": 0,
            "system": "You answer questions about the tides. " * 20,
            "messages": [{"role": "user", "content": "When is high tide?"}]}

    def cached(headers: dict[str, str]) -> int:
        r = httpx.post(f"{smol_server.url}/v1/messages", json=body, headers=headers,
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cache_read_input_tokens"]

    cached({"x-api-key": KEY_A})
    assert cached({"Authorization": f"Bearer {KEY_A}"}) > 100
    assert cached({"x-api-key": KEY_B}) == 0
    m = smol_server.metrics()
    assert m['ember_http_responses_total{route="/v1/messages",status="200"}'] >= 3


def test_an_agents_long_system_prompt_is_read_from_the_cache_on_its_second_turn(
        client, smol_server):
    """A coding agent sends the same long system prompt and tool list every turn (~6k
    tokens here: SmolLM2's window is 8k). The second turn computes only what is new."""
    rules = " ".join(f"Rule {i}: keep the file {i}.py formatted and tested." for i in range(340))
    tools = [WEATHER, ADD] + [{"name": f"tool_{i}", "description": f"Helper number {i}.",
                               "input_schema": {"type": "object", "properties": {
                                   "path": {"type": "string"}}}} for i in range(8)]
    turn = [{"role": "user", "content": "List the files."}]
    system_only = client.messages.count_tokens(model=smol_server.model_id, system=rules,
                                               tools=tools, messages=turn).input_tokens
    assert system_only > 5000
    first = client.messages.create(model=smol_server.model_id, max_tokens=8, extra_body=GREEDY,
                                   system=rules, tools=tools, messages=turn)
    history = turn + [{"role": "assistant", "content": first.content},
                      {"role": "user", "content": "Now format tool_3.py."}]
    second = client.messages.create(model=smol_server.model_id, max_tokens=8, extra_body=GREEDY,
                                    system=rules, tools=tools, messages=history)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= system_only - 16  # up to a block
    assert second.usage.input_tokens < total - system_only + 16
    print(f"second turn: {second.usage.cache_read_input_tokens} of {total} prompt tokens "
          "read from the prefix cache")


# ---------------------------------------------------------------------- thinking


def test_thinking_comes_first_as_a_thinking_block_and_streams_as_thinking_deltas(
        thinking_server):
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0)
    kw = dict(model=thinking_server.model_id, max_tokens=40,
              extra_body={"temperature": 1.0, "seed": 1},
              thinking={"type": "enabled", "budget_tokens": 8},
              messages=[{"role": "user", "content": "hi"}])
    whole = client.messages.create(**kw)
    kinds = [b.type for b in whole.content]
    assert kinds[0] == "thinking" and set(kinds[1:]) <= {"text"}, kinds
    assert whole.content[0].signature and "</think>" not in whole.content[0].thinking
    thought, said = "", ""
    with client.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thought += event.delta.thinking
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                said += event.delta.text
        final = stream.get_final_message()
    assert [b.type for b in final.content] == kinds
    assert thought.strip() == whole.content[0].thinking
    assert said == _text(whole)
    off = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
    assert whole.usage.output_tokens <= 40


def test_a_long_stream_reaches_message_stop(smol_server):
    """The raw event stream, read as bytes: each event names its type twice (the SSE
    event line and its data), and the last is message_stop."""
    with httpx.stream("POST", f"{smol_server.url}/v1/messages", timeout=60,
                      headers={"x-api-key": KEY_A},
                      json={"model": smol_server.model_id, "max_tokens": 16, "stream": True,
                            "messages": [{"role": "user", "content": "Count to ten."}]}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    for event in events:
        name, data = event.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]
    assert events[-1].startswith("event: message_stop")
    wait_for_metrics(smol_server, {"ember_requests_running": 0})


def test_the_sdk_lists_the_served_model(client, smol_server):
    models = list(client.models.list())
    assert [m.id for m in models] == [smol_server.model_id]
    assert models[0].type == "model" and models[0].max_input_tokens > 0


def test_output_config_format_constrains_the_text(client, smol_server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
              "required": ["city"], "additionalProperties": False}
    m = client.messages.create(
        model=smol_server.model_id, max_tokens=60, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Which city is the capital of France?"}])
    jsonschema.validate(json.loads(_text(m)), schema)
