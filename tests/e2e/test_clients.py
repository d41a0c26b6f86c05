"""The client libraries people build on, unchanged, against a real ``ember serve``
(SmolLM2-135M, f32): langchain-openai, instructor, pydantic-ai, the OpenAI Agents SDK
(both model classes), litellm and lm-evaluation-harness. Versions tested are in
docs/server.md ("Client libraries").

Each test uses the library the way its documentation shows and checks what the
library hands back: parsed tool calls and structured objects that validate, an agent
loop that runs a function tool and sends its result back, and lm-eval
loglikelihoods equal to teacher forcing computed in this process from the model.
A 135M model is not a good agent, so schemas are bounded (``max_length``) and a tool
disables itself after one call, so that the loop ends on the library's own terms.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import pytest
import torch
from e2e_server import KEY_A, EmberServer
from pydantic import BaseModel, Field

from ember.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

PERSON_TEXT = "Alice is 31 years old. Extract the person: name and age."


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(max_length=30)
    age: int


def api(server: EmberServer) -> str:
    return f"{server.url}/v1"


# ------------------------------------------------------------------ langchain-openai
@pytest.fixture(scope="module")
def chat_model(smol_server: EmberServer):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=api(smol_server), api_key=KEY_A, model=smol_server.model_id,
                      temperature=0, max_tokens=80, max_retries=0, timeout=120)


def test_langchain_bind_tools_gives_parsed_tool_calls(chat_model):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Annotated[str, Field(max_length=30)]) -> str:
        """Current weather in a city."""
        return "sunny"

    reply = chat_model.bind_tools([get_weather], tool_choice="any").invoke(
        "What's the weather in Paris?")
    assert reply.tool_calls, reply
    for call in reply.tool_calls:
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        assert isinstance(call["args"]["city"], str) and len(call["args"]["city"]) <= 30
    assert not reply.invalid_tool_calls


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_with_structured_output_in_every_method(chat_model, method):
    out = chat_model.with_structured_output(Person, method=method, include_raw=True).invoke(
        PERSON_TEXT)
    if method == "json_mode":
        # json_object promises a JSON object, not the schema (as OpenAI's does)
        assert isinstance(json.loads(out["raw"].content), dict), out["raw"]
        return
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], Person)


# ------------------------------------------------------------------------ instructor
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_model(smol_server, mode):
    import instructor
    import openai

    client = instructor.from_openai(
        openai.OpenAI(base_url=api(smol_server), api_key=KEY_A, max_retries=0, timeout=120),
        mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(
        model=smol_server.model_id, response_model=Person, max_retries=0, max_tokens=60,
        temperature=0, messages=[{"role": "user", "content": PERSON_TEXT}])
    assert isinstance(person, Person)


# ----------------------------------------------------------------------- pydantic-ai
def test_pydantic_ai_default_output_after_a_tool_call(smol_server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel(smol_server.model_id,
                            provider=OpenAIProvider(base_url=api(smol_server), api_key=KEY_A))
    # default output: pydantic-ai's own "final_result" tool, alongside ours
    agent = Agent(model, output_type=Person,
                  model_settings={"temperature": 0, "max_tokens": 80})
    asked: list[str] = []

    async def once(ctx, tool_def):
        return None if asked else tool_def

    @agent.tool_plain(prepare=once)
    def lookup_age(name: Annotated[str, Field(max_length=30)]) -> int:
        """The age of a person, by name."""
        asked.append(name)
        return 31

    result = agent.run_sync("How old is Alice? Use the tool, then answer.",
                            usage_limits=UsageLimits(request_limit=6))
    assert asked, "the agent never called the tool"
    assert isinstance(result.output, Person)
    # the tool's return went back to the server as a tool message
    kinds = [part.part_kind for message in result.all_messages() for part in message.parts]
    assert "tool-return" in kinds, kinds


# ----------------------------------------------------------------- OpenAI Agents SDK
@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_agents_sdk_runs_a_function_tool_and_sends_its_result_back(smol_server, model_class):
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # tracing exports to api.openai.com
    called: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not called)
    def get_weather(city: Annotated[str, Field(max_length=30)]) -> str:
        """Current weather in a city."""
        called.append(city)
        return "sunny"

    client = AsyncOpenAI(base_url=api(smol_server), api_key=KEY_A, max_retries=0, timeout=120)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
        model=getattr(agents, model_class)(model=smol_server.model_id, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=60))
    result = agents.Runner.run_sync(agent, "What's the weather in Paris?", max_turns=4)
    assert len(called) == 1 and 0 < len(called[0]) <= 30
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == ["sunny"]
    assert isinstance(result.final_output, str)  # the turn after the tool's result


# --------------------------------------------------------------------------- litellm
def test_litellm_completion_tools_and_stream(smol_server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from GitHub
    import litellm

    kw = dict(model=f"openai/{smol_server.model_id}", api_base=api(smol_server), api_key=KEY_A,
              temperature=0, max_tokens=60)
    # a closed schema: under an open one the 135M model may go on inventing properties
    # past max_tokens, or not, at a near-tie (with f16 KV it does; with f32 it did not)
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                       "properties": {"city": {"type": "string", "maxLength": 30}}}}}
    r = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}],
                           tools=[weather], tool_choice="required", **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    said = litellm.completion(messages=[{"role": "user", "content": "Say hi."}], **kw)
    streamed = litellm.completion(messages=[{"role": "user", "content": "Say hi."}],
                                  stream=True, **kw)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    assert text and text == said.choices[0].message.content


# ---------------------------------------------------------------------------- lm-eval
MC = [("The capital of France is", ["Paris", "Berlin", "banana"], 0),
      ("Two plus two equals", ["four", "seven", "purple"], 0),
      ("The sky on a clear day is", ["green", "blue", "loud"], 1)]
GEN = ["What is the capital of France?", "What color is the sky?"]


def write_tasks(root: Path) -> Path:
    """A multiple-choice (loglikelihood) and a generate_until task over local JSON."""
    (root / "mc.jsonl").write_text("".join(
        json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC))
    (root / "gen.jsonl").write_text("".join(
        json.dumps({"question": q, "answer": "x"}) + "\n" for q in GEN))
    common = "dataset_path: json\ntest_split: test\ndoc_to_target: \"{{answer}}\"\n"
    (root / "ember_mc.yaml").write_text(
        f"task: ember_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root}/mc.jsonl\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\nmetric_list:\n  - metric: acc\n")
    (root / "ember_gen.yaml").write_text(
        f"task: ember_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root}/gen.jsonl\n"
        "output_type: generate_until\ndoc_to_text: \"Q: {{question}}\\nA:\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


def test_lm_eval_local_completions_loglikelihood_and_generate_until(
        smol_server, smol_reference, tmp_path, monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    # lm-eval sends OPENAI_API_KEY to /v1/completions, auth_token to the tokenizer routes
    monkeypatch.setenv("OPENAI_API_KEY", KEY_A)
    import lm_eval
    from lm_eval.tasks import TaskManager

    # the default tokenizer backend: lm-eval finds /tokenizer_info and /tokenize and
    # uses the server's tokenizer (no tokenizer download)
    out = lm_eval.simple_evaluate(
        model="local-completions", log_samples=True, tasks=["ember_mc", "ember_gen"],
        task_manager=TaskManager(include_path=str(write_tasks(tmp_path))),
        model_args={"model": smol_server.model_id, "base_url": f"{api(smol_server)}/completions",
                    "num_concurrent": 1, "max_retries": 1, "auth_token": KEY_A})
    model = smol_reference.engine.loaded.model
    requests = [(args, resp) for s in out["samples"]["ember_mc"]
                for args, resp in zip(s["arguments"], s["resps"], strict=True)]
    assert len(requests) == sum(len(choices) for _, choices, _ in MC)
    for (context, continuation), ((loglikelihood, is_greedy),) in requests:
        whole, ctx = smol_reference.encode(context + continuation), smol_reference.encode(context)
        assert whole[:len(ctx)] == ctx
        logprobs = torch.log_softmax(  # in the server's KV dtype: the default, as here
            model.score(whole, kv_dtype=smol_reference.engine.config.kv_dtype).float(), dim=-1)
        want = [(logprobs[i - 1], whole[i]) for i in range(len(ctx), len(whole))]
        assert loglikelihood == pytest.approx(sum(float(lp[t]) for lp, t in want), abs=1e-3)
        assert is_greedy == all(int(lp.argmax()) == t for lp, t in want)
    assert out["results"]["ember_mc"]["acc,none"] >= 2 / 3  # the 135M model knows these
    for s in out["samples"]["ember_gen"]:
        (text,), = s["resps"]
        prompt = s["arguments"][0][0]
        greedy, = smol_reference.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                              stop=["\n"]))
        assert text == greedy.text and "\n" not in text

