"""Ollama's API on ember's port: ``/api/chat``, ``/api/generate``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version``.

A translation layer over the chat route's machinery (:mod:`ember.server.routes`): the
same template, tool formats, grammar and reasoning split, the same admission, queue,
keys and metrics. What maps to what:

- ``options``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
  ``num_predict`` (-1 and -2: no cap), ``stop``, ``repeat_penalty``,
  ``presence_penalty``, ``frequency_penalty`` are honoured; when absent, Ollama's
  defaults (temperature 0.8, top_k 40, top_p 0.9; no repeat penalty: ember's applies to
  the whole history, Ollama's to a window). Options about the runtime (``num_ctx``,
  ``num_thread``, ``num_gpu``, ...) are accepted and change nothing; any other is
  refused by name.
- ``format``: ``"json"`` or a JSON schema: the reply is constrained to it.
- ``tools`` (function tools) and past ``tool_calls`` / ``tool`` messages as in the
  OpenAI routes; the reply's ``tool_calls`` are grammar-constrained.
- ``think``: ``true``/``false`` or ``low``/``medium``/``high`` on a model whose template
  thinks; the reasoning comes back in ``message.thinking`` (``thinking`` in generate).
- ``keep_alive``: accepted; the served model stays loaded whatever it says.
- Durations in nanoseconds: ``prompt_eval_duration`` is arrival to first token (queue
  included), ``eval_duration`` first token to the last; ``prompt_eval_count`` counts
  the whole prompt, cached tokens included.

Streaming is Ollama's: one JSON object per line, the last with ``done: true``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import Field

from ember.engine.output import RequestOutput
from ember.models.gguf import GGUFFile
from ember.sampling.constraints import StructuredOutput
from ember.sampling.params import InvalidSamplingParams, SamplingParams
from ember.sampling.reasoning import ReasoningStream
from ember.server import protocol as P
from ember.server import render as R
from ember.server import tools
from ember.server.errors import APIError, unsupported
from ember.server.routes import Built, PromptServer, Route, thinking
from ember.server.transport import dumps

API_VERSION = "0.12.0"  # the Ollama API these routes follow (clients check the version)
SAMPLING_OPTIONS = {"temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "stop",
                    "repeat_penalty", "presence_penalty", "frequency_penalty"}
RUNTIME_OPTIONS = {"num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread",
                   "use_mmap", "use_mlock", "numa", "low_vram", "vocab_only", "f16_kv"}
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _stops(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


_OPTION_TYPES = {"temperature": _number, "top_p": _number, "min_p": _number,
                 "repeat_penalty": _number, "presence_penalty": _number,
                 "frequency_penalty": _number, "top_k": _integer, "seed": _integer,
                 "num_predict": _integer, "num_ctx": lambda v: _integer(v) and v > 0,
                 "stop": _stops}
_OPTION_WANTS = {**dict.fromkeys(_OPTION_TYPES, "a number"), "top_k": "an integer",
                 "seed": "an integer", "num_predict": "an integer",
                 "num_ctx": "a positive integer", "stop": "a string or a list of strings"}
# sampling parameter names -> Ollama's option names
_OPTION_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
THINK_LEVELS = {"low": P.EFFORT_BUDGETS["low"], "medium": P.EFFORT_BUDGETS["medium"],
                "high": P.EFFORT_BUDGETS["high"]}


def error_body(e: APIError) -> dict[str, Any]:
    return {"error": e.message}


def error_line(e: APIError) -> str:
    return dumps(error_body(e)) + "\n"


class ModelLoaded(Exception):
    """A request with nothing to generate (Ollama's way to load a model): answered
    ``done_reason: load`` at once."""

    def __init__(self, req: _OllamaRequest) -> None:
        super().__init__("nothing to generate")
        self.req = req


class _OllamaRequest(P._Conversation):
    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None

    def check_options(self) -> None:
        self.reject_extra()
        for key, value in (self.options or {}).items():
            if key not in SAMPLING_OPTIONS | RUNTIME_OPTIONS:
                raise unsupported(f"options.{key}", "is not supported by this server")
            if value is not None and not _OPTION_TYPES.get(key, lambda v: True)(value):
                raise APIError(400, f"options.{key}: {value!r} is not {_OPTION_WANTS[key]}",
                               param=f"options.{key}")
        if self.think is not None and not isinstance(self.think, bool) \
                and self.think not in THINK_LEVELS:
            raise APIError(400, "think: must be true, false, low, medium or high",
                           param="think")
        if self.format == "json":
            self._structured = P.structured_output({"type": "json_object"}, "format")
        elif isinstance(self.format, dict):
            self._structured = P.structured_output(
                {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}},
                "format")
        elif self.format not in (None, ""):
            raise APIError(400, "format: must be \"json\" or a JSON schema", param="format")
        if self.tool_plan() is not None and self._structured is not None:
            raise unsupported("format", "with tools is not supported")

    def tool_plan(self, style: tools.ToolStyle = P.FALLBACK_TOOLS) -> tools.ToolPlan | None:
        plan = tools.plan(getattr(self, "tools", None), None, None)
        return None if plan is None else dataclasses.replace(plan, style=style)

    def thinking_asked(self, model_thinks: bool) -> tuple[int, str] | None:
        if self.think is None or (self.think is False and not model_thinks):
            return None
        if isinstance(self.think, str):
            return THINK_LEVELS[self.think], "think"
        return (1 << 30 if self.think else 0), "think"

    def sampling(self, structured: StructuredOutput | None) -> SamplingParams:
        o = {**DEFAULTS, **{k: v for k, v in (self.options or {}).items() if v is not None}}
        cap = o.get("num_predict")
        stop = o.get("stop") or []
        try:
            return SamplingParams(
                max_tokens=None if cap is None or cap < 0 else cap,
                temperature=o["temperature"], top_p=o["top_p"], top_k=o["top_k"],
                min_p=o.get("min_p", 0.0), seed=o.get("seed"),
                stop=[stop] if isinstance(stop, str) else list(stop),
                repetition_penalty=o.get("repeat_penalty", 1.0),
                presence_penalty=o.get("presence_penalty", 0.0),
                frequency_penalty=o.get("frequency_penalty", 0.0),
                structured=structured, speculation=self.speculation)
        except (InvalidSamplingParams, TypeError) as e:
            name = getattr(e, "param", None)
            param = f"options.{_OPTION_NAMES.get(name, name)}" if name else "options"
            raise APIError(400, f"{param}: {e}", param=param) from None


class ChatRequest(_OllamaRequest):
    messages: list[Any] = Field(default_factory=list)
    tools: list[Any] | None = None

    def validate_request(self) -> None:
        self.check_options()

    def template_messages(self, style: tools.ToolStyle = P.FALLBACK_TOOLS,
                          plan: tools.ToolPlan | None = None) -> list[dict[str, Any]]:
        """The chat template's messages. A tool result names its call by
        ``tool_call_id``, else it answers the next unanswered call of the assistant
        message before it (ids as :func:`tools.native_calls` makes them)."""
        out, pending = [], []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            msg = _message(m, where)
            calls = msg.get("tool_calls")
            if calls:
                pending = [c.get("id") or f"{where}.{k}" for k, c in enumerate(calls)]
            call_id = msg.get("tool_call_id")
            if msg["role"] == "tool" and call_id is None and pending:
                call_id = pending.pop(0)
            out.append(P.template_turn(msg["role"], msg.get("content") or "", calls or None,
                                       call_id, where, style))
        return P.with_tool_offer(out, plan)


_STRING_FIELDS = ("content", "thinking", "tool_name", "tool_call_id")


def _message(m: Any, where: str) -> dict[str, Any]:
    """``m`` checked: its role, string fields and calls (``id`` optional, as Ollama's)."""
    if not isinstance(m, dict):
        raise APIError(400, f"{where}: must be an object", param=where)
    for key in set(m) - {"role", "tool_calls", "images", *_STRING_FIELDS}:
        raise unsupported(f"{where}.{key}", "is not a recognised field")
    if m.get("images"):
        raise unsupported(f"{where}.images", "are not supported (text models only)")
    if m.get("role") not in ("system", "user", "assistant", "tool"):
        raise APIError(400, f"{where}.role: must be system, user, assistant or tool, got "
                       f"{m.get('role')!r}", param=f"{where}.role")
    for key in _STRING_FIELDS:
        if m.get(key) is not None and not isinstance(m[key], str):
            raise APIError(400, f"{where}.{key}: must be a string", param=f"{where}.{key}")
    calls = m.get("tool_calls")
    if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
        raise APIError(400, f"{where}.tool_calls: a list, on an assistant message only",
                       param=f"{where}.tool_calls")
    for k, call in enumerate(calls or []):
        if not isinstance(call, dict) or (call.get("id") is not None
                                          and not isinstance(call["id"], str)):
            raise APIError(400, f"{where}.tool_calls[{k}]: an object whose id is a string",
                           param=f"{where}.tool_calls[{k}]")
    return m


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None

    def validate_request(self) -> None:
        self.check_options()
        for name in ("suffix", "template", "context", "images"):
            if getattr(self, name):
                raise unsupported(name)


class ShowRequest(P._Body):
    """``/api/show``: which model (``name`` is the older field)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None

    def validate_request(self) -> None:
        self.reject_extra()
        if not (self.model or self.name):
            raise APIError(400, "model: required", param="model")

    @property
    def named(self) -> str:
        return self.model or self.name or ""


def _chat_prompts(server: PromptServer, req: ChatRequest) -> Built:
    if not req.messages:
        raise ModelLoaded(req)
    style = server.tool_style
    plan = req.tool_plan(style)
    ids = server.chat_ids(req.template_messages(style, plan), "messages",
                          req.template_variables(plan))
    return _built(server, req, plan, ids)


def _generate_prompts(server: PromptServer, req: GenerateRequest) -> Built:
    if not req.prompt:
        raise ModelLoaded(req)
    if req.raw:
        server.check_prompt_chars(len(req.prompt), "prompt")
        return _built(server, req, None, server.engine.loaded.encode_prompt(req.prompt),
                      thinks=False)
    msgs = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    return _built(server, req, None, server.chat_ids(msgs, "prompt"))


def _built(server: PromptServer, req: _OllamaRequest, plan: tools.ToolPlan | None,
           ids: list[int], thinks: bool = True) -> Built:
    params = req.sampling(req.output_grammar(plan))
    if not thinks:
        return Built([(ids, [params])], R.Shape(plan))
    budget, split = thinking(server, plan, ids,
                             req.thinking_asked(server.engine.thinking_tags is not None))
    if budget is not None:
        params = dataclasses.replace(params, thinking_budget=budget)
    return Built([(ids, [params])], R.Shape(plan, split))


def _cap(req: _OllamaRequest) -> str:
    return "options.num_predict"


CHAT = Route(ChatRequest, "messages", "format", _chat_prompts, _cap)
GENERATE = Route(GenerateRequest, "prompt", "format", _generate_prompts, _cap)


# ---------------------------------------------------------------------- replies
def now() -> str:
    """Ollama's ``created_at``: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class Clock:
    """When a request arrived, when its first token came and when it ended: Ollama's
    durations, in nanoseconds."""

    def __init__(self) -> None:
        self.start, self.first = time.monotonic_ns(), None

    def saw(self, out: RequestOutput) -> None:
        if self.first is None and out.token_ids:
            self.first = time.monotonic_ns()

    def stats(self, out: RequestOutput) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first or end
        return {"total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_count": out.prompt_tokens, "prompt_eval_duration": first - self.start,
                "eval_count": out.completion_tokens, "eval_duration": end - first}


def _call(call: tools.ToolCall, index: int) -> dict[str, Any]:
    return {"id": call.id, "function": {"index": index, "name": call.name,
                                        "arguments": json.loads(call.arguments)}}


class Reply:
    """The objects of one reply: chat's ``message`` or generate's ``response``."""

    def __init__(self, req: _OllamaRequest, chat: bool) -> None:
        self.req, self.chat = req, chat

    def part(self, thought: str | None, said: str, calls: list[tools.ToolCall] | None = None,
             **end: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.req.model, "created_at": now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": said}
            if thought:
                message["thinking"] = thought
            if calls:
                message["tool_calls"] = [_call(c, k) for k, c in enumerate(calls)]
            body["message"] = message
        else:
            body["response"] = said
            if thought:
                body["thinking"] = thought
        return {**body, "done": bool(end), **end}

    def loaded(self) -> dict[str, Any]:
        """The answer to a request with nothing to generate: ``unload`` when it asked
        for ``keep_alive: 0`` (the served model stays loaded all the same)."""
        unload = self.req.keep_alive in (0, "0", "0s", "0m")
        return self.part(None, "", done_reason="unload" if unload else "load")

    def whole(self, out: RequestOutput, shape: R.Shape, clock: Clock) -> dict[str, Any]:
        thought, text = None, out.text
        if shape.reasoning is not None:
            thought, text = R.split_reply(out.text, shape.reasoning)
        calls = R.tool_calls_of(self.req, shape.tools, out, cap="options.num_predict")
        return self.part(thought, "" if calls else text, calls,
                         done_reason=out.finish_reason, **clock.stats(out))

    async def lines(self, stream: AsyncIterator[tuple[int, RequestOutput]], shape: R.Shape,
                    clock: Clock) -> AsyncIterator[str]:
        """NDJSON: a line per delta, the last with ``done: true`` and the durations. A
        reply that may be tool calls is held back until it is known not to be."""
        plan = shape.tools
        splitter = ReasoningStream(*shape.reasoning) if shape.reasoning is not None else None
        texting = plan is None
        async for _, out in stream:
            clock.saw(out)
            delta, calls = out.delta_text, None
            if not texting:
                if plan is not None and plan.may_be_calls(out.text) and not out.finished:
                    continue
                if out.finished:
                    calls = R.tool_calls_of(self.req, plan, out, cap="options.num_predict")
                texting, delta = not calls, out.text
            if calls:
                thought = (None if shape.reasoning is None
                           else R.split_reply(out.text, shape.reasoning)[0])
                yield _line(self.part(thought, "", calls))
            else:
                thought, said = (splitter.feed(delta, final=out.finished)
                                 if splitter is not None else ("", delta))
                if thought or said:
                    yield _line(self.part(thought, said))
            if out.finished:
                yield _line(self.part(None, "", done_reason=out.finish_reason,
                                      **clock.stats(out)))


def _line(obj: dict[str, Any]) -> str:
    return dumps(obj) + "\n"


# ---------------------------------------------------------------------- models
def _size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".rstrip("0").rstrip(".") + unit
    return str(n)


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What the model routes say of the served model, read once from its GGUF."""

    name: str
    path: Path
    bytes: int
    modified_at: str
    digest: str
    architecture: str
    parameters: int
    quantization: str
    context_length: int
    info: dict[str, Any]

    @classmethod
    def of(cls, loaded: Any, name: str, context_length: int) -> ModelCard:
        gguf = GGUFFile(loaded.path)
        try:
            by_type: dict[str, int] = {}
            for t in gguf.tensors.values():
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
            parameters = sum(t.n_elements for t in gguf.tensors.values())
            arch = gguf.architecture
            info = {k: v for k, v in gguf.metadata.items()
                    if isinstance(v, (int, float, str, bool)) and not k.startswith("tokenizer.")}
        finally:
            gguf.close()
        files = loaded.files or (loaded.path,)
        stat = loaded.path.stat()
        return cls(name, loaded.path, sum(f.stat().st_size for f in files),
                   datetime.fromtimestamp(stat.st_mtime, UTC).isoformat().replace(
                       "+00:00", "Z"),
                   loaded.fingerprint().rsplit(":", 1)[0], arch, parameters,
                   max(by_type, key=by_type.__getitem__), context_length,
                   {**info, "general.parameter_count": parameters,
                    f"{arch}.context_length": context_length})

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": self.architecture,
                "families": [self.architecture], "parameter_size": _size(self.parameters),
                "quantization_level": self.quantization}

    def entry(self) -> dict[str, Any]:
        tagged = self.name if ":" in self.name else f"{self.name}:latest"  # as Ollama lists
        return {"name": tagged, "model": tagged, "modified_at": self.modified_at,
                "size": self.bytes, "digest": self.digest, "details": self.details()}

    def running(self) -> dict[str, Any]:
        return {**self.entry(), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                "context_length": self.context_length}

    def show(self, template: str | None, capabilities: list[str]) -> dict[str, Any]:
        parameters = "\n".join(f"{k} {v}" for k, v in DEFAULTS.items())
        return {"license": "", "modelfile": f"# served by ember\nFROM {self.path}\n",
                "parameters": parameters, "template": template or "",
                "details": self.details(), "model_info": self.info,
                "capabilities": capabilities, "modified_at": self.modified_at}
