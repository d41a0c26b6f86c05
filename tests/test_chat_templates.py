"""Every chat template llama.cpp keeps (``models/templates/*.jinja``, ~70 real ones) as
the server renders it: with a system message, with tools offered, with a past call and
its result, with thinking where the template has it.

Each renders through the same path a chat request takes (the request's messages and
tools, bound to the template's probed :class:`TemplateCaps` and tool format), and what
the conversation says must be in the prompt: the system text, the tool's name, the
call's argument and the tool's result. A template that takes tools natively gets them
in its own words; any other has them described by ember in the system text (Hermes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from llamacpp_source import llamacpp_source

from ember.chat_template import ChatTemplate
from ember.server import protocol as P
from ember.server import tools

pytestmark = pytest.mark.slow

TEMPLATES = sorted((llamacpp_source() / "models" / "templates").glob("*.jinja"))

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"id": "call_7f3a", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
CONVERSATIONS = {
    "system": [{"role": "system", "content": "Answer in French."},
               {"role": "user", "content": "Hello there"}],
    "tools": [{"role": "user", "content": "Weather in Lyon?"}],
    # (no system message: Mistral's templates put it in the last user turn only)
    "tool round": [{"role": "user", "content": "Weather in Lyon?"},
                   {"role": "assistant", "content": "", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_7f3a", "content": "sunny, 21C"}],
}
MUST_SHOW = {"system": ("Answer in French.", "Hello there"),
             "tools": ("get_weather", "Weather in Lyon?"),
             "tool round": ("get_weather", "Lyon", "sunny, 21C")}

# What llama.cpp's corpus should give (a few of each kind; every template is rendered).
EXPECTED_FORMATS = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral_args",
    "Qwen3-Coder": "qwen3_xml",
    "microsoft-Phi-3.5-mini-instruct": None, "google-gemma-2-2b-it": None,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": None,
}


def _template(path: Path) -> ChatTemplate:
    return ChatTemplate(path.read_text(encoding="utf-8"), bos_token="<s>", eos_token="</s>")


def _prompt(template: ChatTemplate, messages: list[dict], with_tools: bool) -> str:
    body = {"model": "m", "messages": messages}
    if with_tools:
        body["tools"] = [TOOL]
    req = P.ChatCompletionRequest.model_validate(body)
    req.validate_request()
    style = tools.tool_style(template)
    plan = req.tool_plan(style)
    segments = template.render_segments(req.template_messages(style, plan),
                                        **req.template_variables(plan))
    return "".join(text for text, _ in segments)


def test_the_corpus_is_there() -> None:
    assert len(TEMPLATES) >= 60, len(TEMPLATES)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_every_template_renders_what_the_conversation_says(path: Path) -> None:
    template = _template(path)
    caps = template.caps  # a template that cannot render a user turn fails here
    for name, messages in CONVERSATIONS.items():
        prompt = _prompt(template, messages, with_tools=name != "system")
        missing = [s for s in MUST_SHOW[name] if s not in prompt]
        assert not missing, (name, missing, caps, prompt[-600:])


@pytest.mark.parametrize("path", [p for p in TEMPLATES if _template(p).caps.thinking],
                         ids=lambda p: p.stem)
def test_thinking_templates_render_with_thinking_on_and_off(path: Path) -> None:
    template = _template(path)
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add them"},
                {"role": "user", "content": "3+3?"}]
    for enable in (True, False):
        prompt = template.render(messages, enable_thinking=enable)
        assert "3+3?" in prompt and "4" in prompt


@pytest.mark.parametrize(("stem", "fmt"), sorted(EXPECTED_FORMATS.items()))
def test_tool_format_is_read_off_the_template(stem: str, fmt: str | None) -> None:
    [path] = [p for p in TEMPLATES if p.stem == stem]
    style = tools.tool_style(_template(path))
    assert (style.fmt.name if style.native else None) == fmt
