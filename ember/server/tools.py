"""Function calling: the tools a request offers, how the prompt presents them, the
grammar that makes every call well-formed, and the parser of the reply.

The wire format is the Hermes/Qwen convention, which many chat models are trained on:
each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; tool results
come back as ``<tool_response>...</tool_response>``. A model whose chat template knows
no tools (SmolLM2's) gets them described in the system message (:func:`system_text`).

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

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ember.sampling.constraints import StructuredOutput
from ember.server.errors import APIError, unsupported

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
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

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def grammar(self) -> StructuredOutput:
        schemas = [t.call_schema() for t in self.callable]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        lines = [f"calls: {calls}",
                 f'call: "{OPEN}" body "{CLOSE}"',
                 f"body: %json {json.dumps(schema)}"]
        if self.choice == "auto":
            lines.insert(0, "start: calls | TEXT")
            lines.append("TEXT: /([^<][\\s\\S]*)?/")
        else:
            lines.insert(0, "start: calls")
        return StructuredOutput.lark("\n".join(lines) + "\n")

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
        if not text.lstrip().startswith(OPEN):
            return None
        calls = []
        for body in _CALL.findall(text):
            try:
                call = json.loads(body)
                name, arguments = call["name"], call["arguments"]
            except (ValueError, KeyError, TypeError):
                return None
            calls.append(ToolCall(f"call_{secrets.token_hex(12)}", name,
                                  json.dumps(arguments, ensure_ascii=False)))
        return calls or None


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


def history_text(content: str, calls: list[Any] | None, where: str) -> str:
    """An assistant turn that called tools, as the model would have written it."""
    parts = [content] if content else []
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
        parts.append(OPEN + json.dumps({"name": fn["name"], "arguments": parsed},
                                       ensure_ascii=False) + CLOSE)
    return "\n".join(parts)


def tool_result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
