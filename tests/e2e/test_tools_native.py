"""Function calling through a model's own template and call format, end to end.

The real SmolLM2, in the default served weight format as in tests/e2e/test_tools.py,
served with three templates of llama.cpp's corpus in place of its own
(``--chat-template``): Llama 3.1's (tools in its words, calls as one JSON object with
``parameters``), Mistral Small 3.2's (``[AVAILABLE_TOOLS]``, calls as
``[TOOL_CALLS]name[ARGS]{...}``) and gpt-oss's harmony (reasoning on the analysis
channel, then a call addressed ``to=functions.name`` or the answer on the final one;
its control tokens spelled in SmolLM2's vocabulary). Through the official ``openai`` SDK: with
``required`` every reply is a call valid against its tool's schema, streamed calls
equal the whole reply, ``auto`` text never starts like a call, and a tool result goes
back through the template natively (its call id made Mistral's nine characters).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import _serve
from e2e_server import EmberServer, served_weights
from llamacpp_source import llamacpp_source
from test_tools import QUESTIONS, SCHEMAS, TOOLS, ask, check_calls

pytestmark = pytest.mark.slow

# template, what a reply of calls starts with, what every request adds: SmolLM2 writes
# harmony's markers in ordinary tokens (~10 each), so its reasoning gets no budget and
# the call all of max_tokens
TEMPLATES = {"Llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct", "{", {}),
             "Mistral-Small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506", "[", {}),
             "gpt-oss": ("openai-gpt-oss-120b", "<|channel|>", {"reasoning_effort": "none"})}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def native(request, smollm2_gguf: Path, e2e_log_dir: Path
           ) -> Iterator[tuple[EmberServer, str, dict[str, Any]]]:
    stem, lead, extra = TEMPLATES[request.param]
    template = llamacpp_source() / "models" / "templates" / f"{stem}.jinja"
    for server in _serve(smollm2_gguf, e2e_log_dir, "--chat-template", str(template),
                         weights=served_weights()):
        yield server, lead, extra


@pytest.fixture(scope="module")
def client(native) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{native[0].url}/v1", api_key="x", max_retries=0,
                         timeout=120)


def _ask_together(client, native, questions: list[str], **kw: Any) -> list[Any]:
    """The questions asked at once (the server batches them), replies in order; the
    k-th with seed k."""
    server, _, extra = native
    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda kq: ask(client, server, kq[1], seed=kq[0], **kw,
                                            **extra), enumerate(questions)))


def test_required_replies_are_valid_calls_in_the_models_format(client, native) -> None:
    for r in _ask_together(client, native, QUESTIONS[:3], tool_choice="required",
                           temperature=0.9, parallel_tool_calls=False):
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(check_calls(r.choices[0].message, set(SCHEMAS))) == 1


def test_streamed_calls_equal_the_whole_reply(client, native) -> None:
    server, _, extra = native
    kw: dict[str, Any] = dict(tool_choice="required", seed=5, temperature=0.7,
                              parallel_tool_calls=False, **extra)
    whole = check_calls(ask(client, server, QUESTIONS[0], **kw).choices[0].message,
                        set(SCHEMAS))
    calls: dict[int, dict[str, str]] = {}
    for chunk in ask(client, server, QUESTIONS[0], stream=True, **kw):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                c["name"] = (d.function and d.function.name) or c["name"]
                c["arguments"] += (d.function and d.function.arguments) or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == whole


def test_auto_text_never_starts_like_a_call(client, native) -> None:
    lead = native[1]
    for r in _ask_together(client, native, [*QUESTIONS[:2], "Say hello."],
                           tool_choice="auto", temperature=0.9):
        message = r.choices[0].message
        if message.tool_calls:
            check_calls(message, set(SCHEMAS))
        else:
            assert message.content and not message.content.lstrip().startswith(lead)


def test_a_tool_result_goes_back_through_the_template(client, native) -> None:
    """The call and its result reach the prompt: longer arguments or a longer result
    make it longer (a template dropping either would not notice the change)."""
    server = native[0]

    def prompt_tokens(arguments: str, result: str) -> int:
        call = {"id": "call_x1", "type": "function",
                "function": {"name": "add", "arguments": arguments}}
        history = [{"role": "user", "content": QUESTIONS[1]},
                   {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_x1", "content": result}]
        r = client.chat.completions.create(model=server.model_id, messages=history,
                                           tools=TOOLS, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens

    base = prompt_tokens('{"a": 2, "b": 40}', "42")
    assert prompt_tokens('{"a": 2, "b": 40}', "42 " * 20) >= base + 19
    assert prompt_tokens('{"a": 2000000000, "b": 4000000000}', "42") >= base + 5
