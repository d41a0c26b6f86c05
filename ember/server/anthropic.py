"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A translation layer, not a second pipeline: a Messages body becomes the same chat
prompt an OpenAI chat request would (the model's template, its tool-call format, the
tool grammar, the reasoning split: :mod:`ember.server.routes`), runs through the same
admission, queue and engine, and its outputs are rendered as Anthropic's message and
event stream. What maps to what:

- ``system`` (a string or text blocks) is the system message; ``user`` text blocks are
  the user's turn, ``tool_result`` blocks are tool messages (``is_error`` says so in
  the result's text); an assistant's ``tool_use`` blocks are its past calls; its
  ``thinking`` blocks are dropped, as chat templates drop past reasoning.
- ``tools`` (custom tools: ``name``, ``description``, ``input_schema``) and
  ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``)
  are OpenAI's function tools, ``required`` and a named tool: the reply's ``tool_use``
  blocks are grammar-constrained and always valid against their schema.
- ``thinking: {type: enabled, budget_tokens}`` is the reasoning budget of a model whose
  template thinks; ``disabled`` closes the reasoning at once; ``adaptive`` and
  ``between_tools`` leave it to the model (``output_config.effort`` caps it as
  ``reasoning_effort`` does). The reply's reasoning comes first, as a ``thinking`` block
  (none with ``display: omitted``).
- ``output_config.format`` (and the beta ``output_format``), a JSON schema: the reply's
  text is constrained to it.
- ``temperature``, ``top_p``, ``top_k``: honoured when sent (the 2.x SDK no longer has
  them as arguments: ``extra_body``); the default temperature is 1.
- ``usage``: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens``
  those the prefix cache served (no ``cache_control`` is needed: every prompt is cached;
  the hints are accepted and ignored), ``cache_creation_input_tokens`` is 0.

Accepted with nothing to do on one machine: ``service_tier`` (auto, standard_only),
``speed: standard``, ``inference_geo``, ``user_profile_id``, ``workspace_id``,
``cache_control``. Refused by name: images and documents, server tools, a final
assistant turn (a prefilled reply), ``container``, ``mcp_servers``,
``context_management``, ``diagnostics``, ``speed: fast``, and any field the API does not
define.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import Field

from ember.engine.output import RequestOutput
from ember.sampling.constraints import StructuredOutput
from ember.sampling.params import InvalidSamplingParams, SamplingParams
from ember.sampling.reasoning import ReasoningStream
from ember.server import protocol as P
from ember.server import render as R
from ember.server import tools
from ember.server.errors import APIError, unsupported
from ember.server.routes import Built, PromptServer, Route, thinking
from ember.server.transport import dumps

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by HTTP status (its "error" objects carry no param or code)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               405: "invalid_request_error", 408: "timeout_error",
               415: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
# A thinking block's signature proves to Anthropic's API that it wrote the block; a local
# model's reasoning has nothing to prove, but the clients expect the field.
SIGNATURE = "ember"
# engine/sampling parameter names -> this API's
_NAMES = {"stop": "stop_sequences"}
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
# output_config.effort -> reasoning tokens allowed (a template that thinks; max: no cap)
EFFORT_BUDGETS = {**P.EFFORT_BUDGETS, "xhigh": 16384, "max": 1 << 30}
del EFFORT_BUDGETS["none"], EFFORT_BUDGETS["minimal"]


def error_body(e: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def error_event(e: APIError) -> str:
    return _event("error", error_body(e))


class MessagesRequest(P._Conversation):
    _needs_max_tokens: ClassVar[bool] = True
    model: str
    messages: list[Any] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None  # extension, as on the OpenAI routes
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the beta name of output_config.format
    # about Anthropic's service, nothing to do on one machine: accepted
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    cache_control: dict[str, Any] | None = None  # every prompt is prefix-cached anyway
    # refused by name
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None

    def validate_request(self) -> None:
        self.reject_extra()
        if self._needs_max_tokens and self.max_tokens is None:
            raise APIError(400, "max_tokens: Field required", param="max_tokens")
        for name in ("container", "mcp_servers", "context_management", "diagnostics"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.service_tier not in (None, "auto", "standard_only"):
            raise unsupported("service_tier", f"{self.service_tier!r} is not supported "
                              "(auto or standard_only)")
        if self.speed not in (None, "standard"):
            raise unsupported("speed", f"{self.speed!r} is not supported (standard)")
        for key in set(self.metadata or {}) - {"user_id"}:
            raise unsupported(f"metadata.{key}", "is not a recognised field (user_id)")
        if any(not s for s in self.stop_sequences or []):
            raise APIError(400, "stop_sequences: each must be non-empty",
                           param="stop_sequences")
        last = self.messages[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            raise unsupported(f"messages[{len(self.messages) - 1}]", "a final assistant turn "
                              "(a prefilled reply) is not supported")
        self._check_thinking()
        self._structured = self._output_format()
        if self.tool_plan() is not None and self._structured is not None:
            raise unsupported("output_config.format", "with tools is not supported")

    def _check_thinking(self) -> None:
        t = self.thinking
        if t is None:
            return
        kind, display = t.get("type"), t.get("display")
        allowed = {"type", "display"} | ({"budget_tokens"} if kind == "enabled" else set())
        if kind not in THINKING_TYPES or set(t) - allowed:
            raise APIError(400, "thinking: must be {\"type\": \"enabled\", \"budget_tokens\": "
                           "N}, adaptive, between_tools or disabled", param="thinking")
        if display not in (None, "summarized", "omitted"):
            raise APIError(400, "thinking.display: must be summarized or omitted",
                           param="thinking.display")
        if kind != "enabled":
            return
        budget = t.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise APIError(400, "thinking.budget_tokens: must be a positive integer",
                           param="thinking.budget_tokens")
        if self.max_tokens is not None and budget >= self.max_tokens:
            raise APIError(400, f"thinking.budget_tokens ({budget}) must be less than "
                           f"max_tokens ({self.max_tokens})", param="thinking.budget_tokens")

    def _output_format(self) -> StructuredOutput | None:
        config = self.output_config or {}
        for key in set(config) - {"effort", "format"}:
            raise unsupported(f"output_config.{key}", "is not a recognised field")
        if config.get("effort") not in (None, *EFFORT_BUDGETS):
            raise APIError(400, f"output_config.effort: must be one of "
                           f"{', '.join(EFFORT_BUDGETS)}", param="output_config.effort")
        fmt, where = config.get("format"), "output_config.format"
        if fmt is None:
            fmt, where = self.output_format, "output_format"
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                or not isinstance(fmt.get("schema"), dict) or set(fmt) - {"type", "schema"}:
            raise APIError(400, f"{where}: must be {{\"type\": \"json_schema\", \"schema\": "
                           "{...}}", param=where)
        return P.structured_output({"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt["schema"]}}, where)

    @property
    def shows_thinking(self) -> bool:
        return (self.thinking or {}).get("display") != "omitted"

    # ------------------------------------------------------------ the prompt
    def tool_plan(self, style: tools.ToolStyle = P.FALLBACK_TOOLS) -> tools.ToolPlan | None:
        choice, parallel = _tool_choice(self.tool_choice, bool(self.tools))
        plan = tools.plan(_function_tools(self.tools or []), choice, parallel, flat=True)
        return None if plan is None else dataclasses.replace(plan, style=style)

    def template_messages(self, style: tools.ToolStyle = P.FALLBACK_TOOLS,
                          plan: tools.ToolPlan | None = None) -> list[dict[str, Any]]:
        """The chat template's messages: the system prompt, then each turn's blocks as
        the served model's template takes text, past calls and their results."""
        out: list[dict[str, Any]] = []
        system = _system_text(self.system)
        if system:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += _turn(m, f"messages[{i}]", style)
        return P.with_tool_offer(out, plan)

    def thinking_asked(self, model_thinks: bool) -> tuple[int, str] | None:
        """The reasoning budget asked for and the field that asked: ``enabled``'s budget
        (a 400 where the model does not think), ``disabled`` none at all, ``adaptive`` and
        ``between_tools`` the model's own choice, or ``output_config.effort``'s share.
        Only ``enabled`` needs a model that thinks."""
        kind = (self.thinking or {}).get("type")
        if kind == "enabled":
            return self.thinking["budget_tokens"], "thinking"  # type: ignore[index]
        if not model_thinks:
            return None
        if kind == "disabled":
            return 0, "thinking"
        effort = (self.output_config or {}).get("effort")
        return None if effort is None else (EFFORT_BUDGETS[effort], "output_config.effort")

    def sampling(self, structured: StructuredOutput | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=self.max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                seed=self.seed, stop=list(self.stop_sequences or []), structured=structured,
                speculation=self.speculation)
        except InvalidSamplingParams as e:
            param = _NAMES.get(e.param, e.param)
            raise APIError(400, f"{param}: {e}", param=param) from None


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages body without ``max_tokens``."""

    _needs_max_tokens: ClassVar[bool] = False


def _system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(_text_block(b, f"system[{j}]") for j, b in enumerate(system))


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise unsupported(f"{where}.type", f"{kind!r} is not supported here (text)")
    extra = set(block) - {"type", "text", "cache_control", "citations"}
    if extra:
        raise unsupported(f"{where}.{sorted(extra)[0]}", "is not a recognised field")
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}.text: must be a string", param=f"{where}.text")
    return block["text"]


def _turn(m: Any, where: str, style: tools.ToolStyle) -> list[dict[str, Any]]:
    """One Messages turn as chat-template messages: a user turn's tool results first
    (each a tool message), then its text; an assistant's text and calls."""
    if not isinstance(m, dict):
        raise APIError(400, f"{where}: must be an object", param=where)
    for key in set(m) - {"role", "content"}:
        raise unsupported(f"{where}.{key}", "is not a recognised field")
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role: must be user or assistant, got {role!r}",
                       param=f"{where}.role")
    if isinstance(content, str):
        return [P.template_turn(role, content, None, None, where, style)]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: must be a string or a list of blocks",
                       param=f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append(_past_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(P.template_turn("tool", _result_text(block, at), None,
                                           _string(block, "tool_use_id", at), at, style))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # past reasoning: templates drop it
        else:
            texts.append(_text_block(block, at))
    turns = results
    if texts or calls or not results:
        turns.append(P.template_turn(role, "\n\n".join(texts), calls or None, None, where,
                                     style))
    return turns


def _string(block: dict[str, Any], key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{at}.{key}: must be a non-empty string", param=f"{at}.{key}")
    return value


def _past_call(block: dict[str, Any], at: str) -> dict[str, Any]:
    for key in set(block) - {"type", "id", "name", "input", "cache_control"}:
        raise unsupported(f"{at}.{key}", "is not a recognised field")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise APIError(400, f"{at}.input: must be an object", param=f"{at}.input")
    return {"id": _string(block, "id", at), "type": "function",
            "function": {"name": _string(block, "name", at),
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _result_text(block: dict[str, Any], at: str) -> str:
    for key in set(block) - {"type", "tool_use_id", "content", "is_error", "cache_control"}:
        raise unsupported(f"{at}.{key}", "is not a recognised field")
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        text = "\n\n".join(_text_block(b, f"{at}.content[{k}]") for k, b in enumerate(content))
    else:
        raise APIError(400, f"{at}.content: must be a string or text blocks",
                       param=f"{at}.content")
    return f"Error: {text}" if block.get("is_error") else text


def _function_tools(offered: list[Any]) -> list[dict[str, Any]]:
    """Custom tools as the Responses API's flat function tools (the same indexes, so
    :func:`tools.plan`'s errors name the client's fields)."""
    out = []
    for i, t in enumerate(offered):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise APIError(400, f"{at}: must be an object", param=at)
        kind = t.get("type", "custom")
        if kind != "custom":
            raise unsupported(f"{at}.type", f"{kind!r} is not supported (server tools are "
                              "Anthropic's own; custom tools with an input_schema are)")
        for key in set(t) - {"type", "name", "description", "input_schema", "cache_control"}:
            raise unsupported(f"{at}.{key}", "is not a recognised field")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise APIError(400, f"{at}.input_schema: must be a JSON schema object",
                           param=f"{at}.input_schema")
        out.append({"type": "function", "name": t.get("name"),
                    "description": t.get("description") or "", "parameters": schema})
    return out


def _tool_choice(choice: dict[str, Any] | None, offered: bool) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(400, "tool_choice.type: must be auto, any, tool or none",
                       param="tool_choice.type")
    for key in set(choice) - {"type", "name", "disable_parallel_tool_use"}:
        raise unsupported(f"tool_choice.{key}", "is not a recognised field")
    if kind in ("any", "tool") and not offered:
        raise APIError(400, f"tool_choice: {kind!r} needs tools", param="tool_choice")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise APIError(400, "tool_choice.name: required with type 'tool'",
                           param="tool_choice.name")
        return {"type": "function", "name": name}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _prompts(server: PromptServer, req: MessagesRequest) -> Built:
    style = server.tool_style
    plan = req.tool_plan(style)
    ids = prompt_ids(server, req, plan)
    params = req.sampling(req.output_grammar(plan))
    asked = req.thinking_asked(server.engine.thinking_tags is not None)
    budget, split = thinking(server, plan, ids, asked)
    if budget is not None:
        params = dataclasses.replace(params, thinking_budget=budget)
    return Built([(ids, [params])], R.Shape(plan, split))


def prompt_ids(server: PromptServer, req: MessagesRequest,
               plan: tools.ToolPlan | None) -> list[int]:
    """The prompt the served model sees for ``req`` (what count_tokens counts)."""
    return server.chat_ids(req.template_messages(server.tool_style, plan), "messages",
                           req.template_variables(plan))


MESSAGES = Route(MessagesRequest, "messages", "output_config.format", _prompts)


def model_list(names: list[str], created: float, context: int) -> dict[str, Any]:
    """``GET /v1/models`` as Anthropic's SDK reads it (asked with ``anthropic-version``)."""
    at = datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")
    data = [{"id": n, "type": "model", "display_name": n, "created_at": at,
             "lifecycle": "active", "max_input_tokens": context} for n in names]
    return {"data": data, "has_more": False, "first_id": names[0], "last_id": names[-1]}


# ---------------------------------------------------------------------- replies
def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {"input_tokens": out.prompt_tokens - out.cached_tokens,
            "output_tokens": out.completion_tokens,
            "cache_read_input_tokens": out.cached_tokens, "cache_creation_input_tokens": 0}


def _stop(req: MessagesRequest, out: RequestOutput, calls: list[Any] | None
          ) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``: ``max_tokens`` whenever the cap ended the reply,
    even after complete calls (a further one was cut short)."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if out.stop_string is not None and out.stop_string in (req.stop_sequences or []):
        return "stop_sequence", out.stop_string
    return "end_turn", None


def _calls(shape: R.Shape, out: RequestOutput) -> tuple[list[tools.ToolCall] | None, bool]:
    """The reply's complete calls, and whether its text is a call cut short by
    ``max_tokens`` (sent as nothing: Anthropic's ``stop_reason: max_tokens`` says so)."""
    plan = shape.tools
    if plan is None:
        return None, False
    calls = plan.parse(out.text)
    return calls, calls is None and plan.may_be_calls(out.text)


def _tool_use(call: tools.ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": json.loads(call.arguments)}


def _message(req: MessagesRequest, msg_id: str, content: list[dict[str, Any]],
             usage: dict[str, Any], stop: tuple[str | None, str | None] = (None, None)
             ) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": usage}


def message_body(req: MessagesRequest, out: RequestOutput, shape: R.Shape,
                 msg_id: str) -> dict[str, Any]:
    thought, text = None, out.text
    if shape.reasoning is not None:
        thought, text = R.split_reply(out.text, shape.reasoning)
    calls, cut_call = _calls(shape, out)
    content: list[dict[str, Any]] = []
    if thought and req.shows_thinking:
        content.append({"type": "thinking", "thinking": thought, "signature": SIGNATURE})
    if calls:
        content += [_tool_use(c) for c in calls]
    elif (text or not content) and not cut_call:
        content.append({"type": "text", "text": text})
    return _message(req, msg_id, content, _usage(out), _stop(req, out, calls))


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {dumps(data)}\n\n"


class _Blocks:
    """The content blocks of a streamed message: one open at a time, in order."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [_event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block})]

    def delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""}}
        events = self.open(kind, start[kind]) if self.kind != kind else []
        return events + [_event("content_block_delta", {
            "type": "content_block_delta", "index": self.index, "delta": delta})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(_event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "signature_delta", "signature": SIGNATURE}}))
        self.kind = None
        return events + [_event("content_block_stop", {"type": "content_block_stop",
                                                       "index": self.index})]

    def said(self, thought: str, text: str) -> list[str]:
        events = []
        if thought:
            events += self.delta("thinking", {"type": "thinking_delta", "thinking": thought})
        if text:
            events += self.delta("text", {"type": "text_delta", "text": text})
        return events


async def message_events(stream: AsyncIterator[tuple[int, RequestOutput]],
                         req: MessagesRequest, shape: R.Shape, msg_id: str
                         ) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, ping, each block's start, deltas and
    stop, message_delta (stop reason, output tokens), message_stop. A reply that may be
    tool calls is held back until it is known not to be (calls are sent whole, each
    block's input as one ``input_json_delta``)."""
    plan, blocks = shape.tools, _Blocks()
    splitter = ReasoningStream(*shape.reasoning) if shape.reasoning is not None else None
    texting, started, calls, cut_call = plan is None, False, None, False
    async for _, out in stream:
        if not started:
            started = True
            usage = {**_usage(out), "output_tokens": 0}
            yield _event("message_start", {"type": "message_start",
                                           "message": _message(req, msg_id, [], usage)})
            yield _event("ping", {"type": "ping"})
        delta = out.delta_text
        if not texting:
            if plan is not None and plan.may_be_calls(out.text) and not out.finished:
                continue
            calls, cut_call = _calls(shape, out) if out.finished else (None, False)
            texting, delta = not calls, "" if cut_call else out.text
        if calls:
            thought = None if shape.reasoning is None else R.split_reply(out.text,
                                                                         shape.reasoning)[0]
            for event in blocks.said(thought if req.shows_thinking and thought else "", ""):
                yield event
            for call in calls:
                for event in blocks.open("tool_use", {**_tool_use(call), "input": {}}):
                    yield event
                yield _event("content_block_delta", {
                    "type": "content_block_delta", "index": blocks.index,
                    "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        elif splitter is not None:
            thought, said = splitter.feed(delta, final=out.finished)
            for event in blocks.said(thought if req.shows_thinking else "", said):
                yield event
        else:
            for event in blocks.said("", delta):
                yield event
        if out.finished:
            if blocks.index < 0 and not cut_call:  # an empty reply: one empty text block
                for event in blocks.open("text", {"type": "text", "text": ""}):
                    yield event
            for event in blocks.close():
                yield event
            reason, sequence = _stop(req, out, calls)
            yield _event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {**_usage(out)}})
            yield _event("message_stop", {"type": "message_stop"})
