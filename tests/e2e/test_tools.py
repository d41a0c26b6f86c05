"""Function calling through the official ``openai`` SDK against the real SmolLM2 (f32):
with ``required`` or a named tool every reply is a call whose arguments validate
against the tool's schema; streaming gives the same calls; a tool result turn goes
back in; bad tool definitions are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from e2e_server import KEY_A, EmberServer

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What's the weather in Paris?", "Add 2 and 40.", "Is it cold in Oslo today?",
             "What is 7 plus 8?"]


@pytest.fixture(scope="module")
def client(smol_server: EmberServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=KEY_A, max_retries=0,
                         timeout=120)


def ask(client, server, question: str, **kw: Any):
    return client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": question}],
        tools=TOOLS, max_tokens=80, **kw)


def check_calls(message, allowed: set[str]) -> list[tuple[str, dict]]:
    assert message.content is None and message.tool_calls
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_required_and_named_replies_are_always_valid_calls(client, smol_server):
    for k, question in enumerate(QUESTIONS):
        for seed in (0, 1):
            r = ask(client, smol_server, question, tool_choice="required", seed=seed,
                    temperature=0.9)
            assert r.choices[0].finish_reason == "tool_calls"
            check_calls(r.choices[0].message, set(SCHEMAS))
        named = ask(client, smol_server, question, seed=k, temperature=0.9,
                    tool_choice={"type": "function", "function": {"name": "add"}},
                    parallel_tool_calls=False)
        assert len(check_calls(named.choices[0].message, {"add"})) == 1


def test_streamed_calls_equal_the_whole_reply(client, smol_server):
    kw = dict(tool_choice="required", seed=3, temperature=0.7)
    whole = check_calls(ask(client, smol_server, QUESTIONS[0], **kw).choices[0].message,
                        set(SCHEMAS))
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in ask(client, smol_server, QUESTIONS[0], stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function and d.function.name:
                    c["name"] = d.function.name
                if d.function and d.function.arguments:
                    c["arguments"] += d.function.arguments
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == whole


def test_auto_answers_in_text_or_in_valid_calls(client, smol_server):
    for k, question in enumerate(QUESTIONS + ["Say hello."]):
        r = ask(client, smol_server, question, tool_choice="auto", seed=k, temperature=0.9)
        message = r.choices[0].message
        if message.tool_calls:
            check_calls(message, set(SCHEMAS))
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            assert message.content and not message.content.startswith("<")


def test_a_tool_result_turn_goes_back_through_the_template(client, smol_server):
    first = ask(client, smol_server, QUESTIONS[1], tool_choice="required", seed=1,
                temperature=0)
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": "42"}
               for c in message.tool_calls]
    history = [{"role": "user", "content": QUESTIONS[1]}, message, *results]
    r = client.chat.completions.create(model=smol_server.model_id, messages=history,
                                       tools=TOOLS, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = httpx.post(f"{smol_server.url}/tokenize", headers={
        "Authorization": f"Bearer {KEY_A}"}, json={"messages": [
            {"role": "user", "content": QUESTIONS[1]},
            {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}]}).json()
    assert r.usage.prompt_tokens > tokens["count"]  # the call and the tools were rendered


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto",
     "tools[0].function.name"),
    ([{"type": "code_interpreter"}], "auto", "tools[0].type"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
     "required", "tools"),
])
def test_bad_tool_definitions_are_400_naming_the_field(smol_server, tools, choice, param):
    r = httpx.post(f"{smol_server.url}/v1/chat/completions", timeout=60, headers={
        "Authorization": f"Bearer {KEY_A}"}, json={
        "model": smol_server.model_id, "messages": [{"role": "user", "content": "hi"}],
        "tools": tools, "tool_choice": choice, "max_tokens": 5})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------- responses
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_function_calls_valid_streamed_and_sent_back(client, smol_server):
    # seeded, so the streamed run repeats the plain one; room for a verbose call (an
    # unseeded run once spent 80 tokens inside one call's arguments)
    kw = dict(model=smol_server.model_id, tools=RESPONSES_TOOLS, tool_choice="required",
              max_output_tokens=160, temperature=0.7, extra_body={"seed": 3})
    r = client.responses.create(input=QUESTIONS[0], **kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and len(calls) == len(r.output)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    events = list(client.responses.create(input=QUESTIONS[0], stream=True, **kw))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    for e in done:
        json.loads(e.arguments)
    # the calls and their outputs go back in as input items
    history = [{"role": "user", "content": QUESTIONS[0]},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name,
                  "arguments": c.arguments} for c in calls],
               *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                 for c in calls]]
    again = client.responses.create(model=smol_server.model_id, input=history,
                                    tools=RESPONSES_TOOLS, max_output_tokens=16)
    assert again.status in ("completed", "incomplete")
    plain = client.responses.create(model=smol_server.model_id, input=history[:1],
                                    tools=RESPONSES_TOOLS, max_output_tokens=1)
    # each call and its output add their JSON and tags: well over 10 tokens
    assert again.usage.input_tokens > plain.usage.input_tokens + 10 * len(calls)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add",
                 "arguments": "{not json"}]}, "input[0].arguments"),
])
def test_bad_responses_tool_requests_are_400_naming_the_field(smol_server, body, param):
    r = httpx.post(f"{smol_server.url}/v1/responses", timeout=60, headers={
        "Authorization": f"Bearer {KEY_A}"}, json={
        "model": smol_server.model_id, "input": "hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
