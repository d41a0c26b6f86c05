"""Function calling: the tools a request offers, how the prompt presents them, the
grammar that makes every call well-formed, and the parser of the reply.

A model whose chat template takes tools and renders calls and results in the history
(probed at load, :class:`ember.chat_template.TemplateCaps`), in a call format ember
knows (:mod:`ember.tool_formats`: Hermes, Llama 3 JSON, Mistral, Qwen3-Coder
XML, functionary, DeepSeek R1, gpt-oss's harmony …), gets them natively: the
template presents the tools and past calls as the model was trained to see them, and
the reply is constrained to that format. Any other model (SmolLM2's template knows
no tools) gets them in the Hermes convention, described in the system message
(:meth:`ToolPlan.system_text`): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, results come back as
``<tool_response>...</tool_response>`` in a user turn.

Generation is constrained (llguidance, through ``StructuredOutput.lark``):

- ``required`` or a named tool: the reply is one or more calls (one unless
  ``parallel_tool_calls``), each ``{"name", "arguments"}`` valid against its tool's
  JSON schema — never plain text;
- ``auto``: the reply is either text that does not start with ``<`` or such calls;
- ``none``: no tools are offered and nothing is constrained.

So a parsed call always has a known name and arguments valid for it; the only way to
get none under ``required`` is running out of ``max_tokens`` inside it, which is an
error naming ``max_tokens``.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ember.sampling.constraints import StructuredOutput
from ember.server.errors import APIError, unsupported
from ember.tool_formats import FALLBACK, HERMES, ToolStyle, tool_style

__all__ = ["FALLBACK", "ToolStyle", "tool_style"]  # the server takes them from here too

OPEN, CLOSE = HERMES.open, HERMES.close
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}




@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def call_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": self.name},
                                                 "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the API carries it

    def as_api(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools asks for (``tool_choice`` other than ``none``)."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required", or the name of the one tool to call
    parallel: bool
    style: ToolStyle = FALLBACK

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def grammar(self) -> StructuredOutput:
        schemas = {t.name: t.parameters for t in self.callable}
        return StructuredOutput.lark(self.style.fmt.grammar(schemas, self.parallel,
                                                            self.choice == "auto"))

    def may_be_calls(self, text: str) -> bool:
        """Whether a reply beginning with ``text`` may still turn out to be calls (a
        streamed reply is held back until it cannot)."""
        return self.style.fmt.may_be_calls(text)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as a template takes them (the API's function objects)."""
        return [{"type": "function", "function": {"name": t.name, "description":
                                                  t.description, "parameters": t.parameters}}
                for t in self.tools]

    def system_text(self) -> str:
        """The tools, described for a model whose template does not take them."""
        listed = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                       "parameters": t.parameters}) for t in self.tools)
        how = ("one call" if not self.parallel else "one or more calls, one per line")
        rule = {"auto": "If a function helps, reply with " + how + " and nothing else; "
                        "otherwise answer normally.",
                "required": "Reply with " + how + " and nothing else."}.get(
            self.choice, f"Reply with a call to {self.choice} and nothing else.")
        return ("You can call these functions (JSON schemas of their arguments):\n"
                f"{listed}\nA call is written {OPEN}{{\"name\": <function name>, "
                f"\"arguments\": <arguments object>}}{CLOSE}. {rule}")

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in a reply, or None if it is text. Grammar-built replies always
        parse; a reply cut short by ``max_tokens`` inside a call does not."""
        calls = self.style.fmt.parse(text, {t.name: t.parameters for t in self.tools})
        if calls is None:
            return None
        return [ToolCall(f"call_{secrets.token_hex(12)}", name,
                         json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]


def plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
         flat: bool = False) -> ToolPlan | None:
    """Validate ``tools`` and ``tool_choice`` (400s name the field); None: no tools.
    ``flat``: the Responses API's shape, the function's fields beside ``type``."""
    parsed = _tools(tools or [], flat)
    choice = _choice(tool_choice, parsed)
    if choice == "none" or not parsed:
        return None
    return ToolPlan(tuple(parsed), choice, True if parallel is None else bool(parallel))


def _tools(tools: list[Any], flat: bool) -> list[Tool]:
    out: list[Tool] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise unsupported(f"tools[{i}].type", f"{kind!r} is not supported (function)")
        where = f"tools[{i}]" if flat else f"tools[{i}].function"
        fn = {k: v for k, v in t.items() if k != "type"} if flat else t.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"'{where}' must be an object", param=where)
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise unsupported(f"{where}.{sorted(extra)[0]}", "is not a recognised field")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"'{where}.name' must be 1-64 letters, digits, '_' or '-', "
                           f"got {name!r}", param=f"{where}.name")
        if any(o.name == name for o in out):
            raise APIError(400, f"'{where}.name': {name!r} is offered twice",
                           param=f"{where}.name")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise APIError(400, f"'{where}.description' must be a string",
                           param=f"{where}.description")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise APIError(400, f"'{where}.parameters' must be a JSON schema object",
                           param=f"{where}.parameters")
        out.append(Tool(name, description, parameters))
    return out


def _choice(choice: Any, tools: list[Tool]) -> str:
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "'tool_choice': 'required' needs 'tools'", param="tool_choice")
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if not isinstance(name, str):
        raise APIError(400, "'tool_choice' must be none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
    if not any(t.name == name for t in tools):
        raise APIError(400, f"'tool_choice' names {name!r}, which is not in 'tools'",
                       param="tool_choice")
    return name


def _checked_calls(calls: list[Any] | None, where: str) -> list[tuple[str, Any, Any]]:
    """(name, parsed arguments, id) of each of an assistant message's ``tool_calls``."""
    out = []
    for k, call in enumerate(calls or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"'{where}.tool_calls[{k}].function.name' is required",
                           param=f"{where}.tool_calls[{k}].function.name")
        arguments = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise APIError(400, f"'{where}.tool_calls[{k}].function.arguments' is not JSON",
                           param=f"{where}.tool_calls[{k}].function.arguments") from None
        out.append((fn["name"], parsed, call.get("id")))
    return out


def history_text(content: str, calls: list[Any] | None, where: str) -> str:
    """An assistant turn that called tools, as a Hermes model would have written it."""
    parts = [content] if content else []
    for name, arguments, _ in _checked_calls(calls, where):
        parts.append(OPEN + json.dumps({"name": name, "arguments": arguments},
                                       ensure_ascii=False) + CLOSE)
    return "\n".join(parts)


def native_calls(calls: list[Any] | None, where: str, style: ToolStyle) -> list[dict[str, Any]]:
    """An assistant message's calls as a template takes them: ids made nine letters and
    digits (Mistral's templates refuse any other; the mapping is stable, so a result's
    ``tool_call_id`` maps the same way), arguments objects or JSON text as it wants."""
    return [{"id": call_id(cid or f"{where}.{k}"), "type": "function",
             "function": {"name": name, "arguments": arguments if style.object_arguments
                          else json.dumps(arguments, ensure_ascii=False)}}
            for k, (name, arguments, cid) in enumerate(_checked_calls(calls, where))]


def call_id(given: str) -> str:
    """A tool call id as nine letters and digits (kept when it already is)."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", given):
        return given
    return hashlib.sha256(given.encode()).hexdigest()[:9]


def tool_result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
