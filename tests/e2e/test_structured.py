"""Structured outputs over HTTP: response_format on chat and completions, text.format on
responses, and the regex / Lark extensions; a bad grammar is a 400 before generation."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import lark
import openai
import pytest
from e2e_server import KEY_A, EmberServer

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "country": {"type": "string", "maxLength": 24}}}
GRAMMAR = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"\n'


@pytest.fixture(scope="module")
def client(smol_server: EmberServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=KEY_A, max_retries=0,
                         timeout=60)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_chat_json_schema_output_validates(client, smol_server, temperature):
    r = client.chat.completions.create(
        model=smol_server.model_id, messages=ask("Name a city and its country."),
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}},
        max_tokens=80, temperature=temperature, seed=5)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_chat_json_object_is_an_object(client, smol_server):
    r = client.chat.completions.create(
        model=smol_server.model_id, messages=ask("Reply with a JSON object about a cat."),
        response_format={"type": "json_object"}, max_tokens=60, temperature=0.7, seed=1)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object (see docs/constrained.md)
        assert r.choices[0].message.content.startswith("{")


def test_responses_text_format_json_schema_validates(client, smol_server):
    r = client.responses.create(
        model=smol_server.model_id, input="Name a city.", max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_completions_regex_and_lark_extensions(client, smol_server):
    r = client.completions.create(model=smol_server.model_id, prompt="Call me at",
                                  max_tokens=20, temperature=0.8, seed=2,
                                  extra_body={"response_format": {"type": "regex",
                                                                  "regex": r" \d{3}-\d{4}"}})
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text)
    r = client.completions.create(model=smol_server.model_id, prompt="Is it raining?",
                                  max_tokens=20, temperature=0.8, seed=3,
                                  extra_body={"response_format": {"type": "lark",
                                                                  "lark": GRAMMAR}})
    lark.Lark(GRAMMAR).parse(r.choices[0].text)


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "regex", "regex": "[a-"}, "response_format"),
    ({"type": "lark", "lark": "start: undefined"}, "response_format"),
    ({"type": "xml"}, "response_format.type"),
])
def test_bad_grammars_are_400_before_any_generation(smol_server, fmt, param):
    before = smol_server.metrics().get("ember_prefix_cache_queries_total", 0)
    r = httpx.post(f"{smol_server.url}/v1/chat/completions",
                   headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30,
                   json={"model": smol_server.model_id, "messages": ask("hi"),
                         "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # nothing reached the engine: no prompt was looked up in the prefix cache
    assert smol_server.metrics().get("ember_prefix_cache_queries_total", 0) == before
