"""Render a model's Jinja2 chat template into the prompt text.

The environment mirrors the one HuggingFace ``transformers`` renders chat templates
with, since templates are written against it: a sandboxed Jinja2 environment with
``trim_blocks``, ``lstrip_blocks``, the loop-controls extension (``{% break %}``/
``{% continue %}``) and ``{% generation %}`` blocks (rendered as their body); the
``tojson`` filter dumps JSON without ASCII escaping or HTML escaping (``indent``,
``separators``, ``sort_keys`` accepted; generators as lists); globals
``raise_exception(msg)`` (raises ``ChatTemplateError(msg)``) and ``strftime_now(fmt)``
(local time now). Undefined variables render as empty, as in transformers, so
templates may test ``x is defined``. Unlike transformers the sandbox lets a template
append to its own lists (Kimi's templates do; llama.cpp allows it): the messages a
template sees are copies made for one rendering.

What a template can do is probed once, by rendering it (:class:`TemplateCaps`): a
system role, tools, tool calls and results in the history, thinking. A template
without a system role gets the system message at the head of the first user turn.

The rendered text contains control-token strings (``<|im_start|>``...): encode it
with ``Tokenizer.encode(text, parse_special=True)``.

A GGUF without ``tokenizer.chat_template`` (base models, e.g. Gemma 3 270M) makes
``ChatTemplate.from_gguf`` raise ``ChatTemplateError`` unless the caller passes a
``default`` source; ``CHATML_TEMPLATE`` is offered for callers that choose ChatML.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import SandboxedEnvironment

from ember.errors import ChatTemplateError, InvalidMessage
from ember.template_sandbox import BoundedEnvironment, check_width, render_bounded

# Plain ChatML, for callers that opt in when a GGUF carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; chat templates need
    # the JSON verbatim (tool schemas), as transformers renders it.
    # its output is then linear in its input
    check_width(len(indent) if isinstance(indent, str) else indent, "tojson indent")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
        sort_keys=sort_keys, default=_listed)


def _listed(value: Any) -> Any:
    """What json cannot dump: a generator or other iterable (``map`` filter output)."""
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON "
                        "serializable") from None


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's
    tokens with it (for training masks); rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> SandboxedEnvironment:
    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _Generation],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_name", "description": "probe",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}},
                   "required": ["probe_arg"]}}}


def _probe_calls(object_arguments: bool) -> list[dict[str, Any]]:
    arguments: Any = {"probe_arg": "probe_value"}
    call = {"id": "call00001", "type": "function",
            "function": {"name": "probe_tool_name",
                         "arguments": arguments if object_arguments else json.dumps(arguments)}}
    return [{"role": "user", "content": "probe_question"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call00001", "name": "probe_tool_name",
             "content": "probe_result"}]  # the model answers next, as after a real call


@dataclass(frozen=True)
class TemplateCaps:
    """What a template renders, found by rendering it (as llama.cpp's minja does)."""

    system: bool  # a system message (else it joins the first user turn)
    tools: bool  # the tools it is given (else ember describes them in the system text)
    tool_calls: bool  # an assistant's calls and the tool's result, in the history
    object_arguments: bool  # calls' arguments as objects; False: as JSON text
    thinking: bool  # the template knows thinking (reasoning_content, <think>, a switch)


class ChatTemplate:
    """A compiled chat template. ``render`` turns messages into prompt text.

    Raises ``ChatTemplateError`` for a template with a syntax error (at
    construction) and for any failure while rendering.
    """

    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template syntax error at line {e.lineno}: {e.message}"
            ) from None
        except RecursionError:  # Jinja's parser recurses once per nesting level
            raise ChatTemplateError("chat template nests too deeply to parse") from None
        # firefunction's templates read the tools as a JSON string called ``functions``
        self._wants_functions = re.search(r"\bfunctions\b", source) is not None

    @functools.cached_property
    def caps(self) -> TemplateCaps:
        """Probed once. A template that cannot render a plain user turn is refused here,
        at load, with the template's own error."""
        user = [{"role": "user", "content": "probe_question"}]
        self._render(user, add_generation_prompt=True)  # raises for a broken template

        def shows(needles: tuple[str, ...], messages: list[dict[str, Any]], **extra: Any
                  ) -> bool:
            try:
                out = self._render(messages, add_generation_prompt=True, **extra)
            except ChatTemplateError:
                return False
            return all(n in out for n in needles)

        system = shows(("probe_system",), [{"role": "system", "content": "probe_system"},
                                           *user])
        tools = shows(("probe_tool_name",), user, tools=[_PROBE_TOOL])
        needles = ("probe_tool_name", "probe_value", "probe_result")
        as_objects = shows(needles, _probe_calls(True), tools=[_PROBE_TOOL])
        calls = as_objects or shows(needles, _probe_calls(False), tools=[_PROBE_TOOL])
        thinking = any(k in self.source for k in ("reasoning_content", "<think>",
                                                  "enable_thinking", "thinking"))
        return TemplateCaps(system, tools, calls, as_objects or not calls, thinking)

    PROBE_CALL = ("probe_tool_name", {"probe_arg": "probe_value"})

    def past_call_text(self) -> str | None:
        """How the template writes a past assistant call of ``PROBE_CALL`` (with its
        result), or None when it renders none: the call format its model was taught."""
        if not self.caps.tool_calls:
            return None
        return self._render(_probe_calls(self.caps.object_arguments),
                            add_generation_prompt=False, tools=[_PROBE_TOOL])

    @classmethod
    def from_gguf(cls, gguf_file: Any, *, default: str | None = None) -> ChatTemplate:
        """The template in the GGUF's ``tokenizer.chat_template``.

        Without one, ``default`` is used if given, else ``ChatTemplateError``.
        ``bos_token``/``eos_token`` are the texts of the GGUF's BOS/EOS ids ("" if absent).
        """
        meta = gguf_file.metadata
        source = meta.get("tokenizer.chat_template", default)
        if source is None:
            raise ChatTemplateError(
                f"{getattr(gguf_file, 'path', 'GGUF')}: no tokenizer.chat_template "
                "(a base model?); pass a template explicitly"
            )
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def text_of(key: str) -> str:
            tid = meta.get(key)
            return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else ""

        return cls(
            str(source),
            bos_token=text_of("tokenizer.ggml.bos_token_id"),
            eos_token=text_of("tokenizer.ggml.eos_token_id"),
        )

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for ``messages`` (dicts with at least ``role``/``content``).

        ``extra`` is passed to the template as variables (e.g. ``tools``); it may
        override ``bos_token``/``eos_token``.
        """
        messages = copy.deepcopy(messages)  # a template may change what it is given
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system" \
                and not self.caps.system:
            messages = _system_in_first_turn(messages)
        return self._render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                **extra: Any) -> str:
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        if self._wants_functions:
            variables.setdefault("functions", json.dumps(
                [t.get("function", t) for t in extra.get("tools") or []], indent=2))
            variables.setdefault("datetime", datetime.now().strftime("%b %d %Y %H:%M:%S GMT"))
        try:
            return render_bounded(self._template, dict(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables))
        except ChatTemplateError:
            raise
        except Exception as e:  # any failure inside the template is the template's error
            raise ChatTemplateError(
                f"chat template failed to render: {type(e).__name__}: {e}"
            ) from e

    def render_segments(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> list[tuple[str, bool]]:
        """The prompt as ``(text, trusted)`` segments: template text vs message content.

        Each string ``content`` is wrapped in private-use marker characters while
        rendering; the markers split the output into what the template wrote (trusted:
        its control tokens count) and what the caller's messages contributed (never
        parsed for control tokens). Markers already present in content are dropped.
        Messages are checked first (:func:`check_messages`): anything but string
        content would reach the template unmarked, that is, trusted.
        """
        marked = [_marked(m) for m in check_messages(messages)]
        text = self.render(marked, add_generation_prompt=add_generation_prompt, **extra)
        segments: list[tuple[str, bool]] = []
        for i, outer in enumerate(text.split(_OPEN)):
            if i == 0:
                segments.append((outer, True))
                continue
            inner, sep, rest = outer.partition(_CLOSE)
            if not sep:  # the template cut the content short: trust none of what follows
                segments.append((_strip_markers(inner), False))
                continue
            segments.append((inner, False))
            segments.append((_strip_markers(rest), True))
        return [(t, trusted) for t, trusted in segments if t]


def _system_in_first_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system message's text at the head of the first user turn (Gemma's templates
    refuse a system role; llama.cpp joins them the same way)."""
    system, rest = messages[0], list(messages[1:])
    for i, m in enumerate(rest):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            rest[i] = {**m, "content": f"{system.get('content') or ''}\n\n{m['content']}"}
            return rest
    return [{"role": "user", "content": system.get("content") or ""}, *rest]


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    """The message with every text the caller wrote between markers: its content and
    the argument values of its tool calls (a template writes them out as JSON)."""
    out = {**message, "content": _mark(message["content"])}
    if "tool_calls" in message:
        out["tool_calls"] = [
            {**c, "function": {**c["function"],
                               "arguments": _mark_values(c["function"]["arguments"])}}
            for c in message["tool_calls"]]
    return out


def _mark(text: str) -> str:
    return _OPEN + _strip_markers(text) + _CLOSE


def _mark_values(value: Any) -> Any:
    if isinstance(value, str):
        return _mark(value)
    if isinstance(value, dict):
        return {_mark_values(k): _mark_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark_values(v) for v in value]
    return value


ROLES = ("system", "user", "assistant", "tool")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise InvalidMessage(f"{where}.tool_calls", "must be a list of calls")
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not _NAME.fullmatch(str(fn.get("name"))):
            raise InvalidMessage(f"{where}.tool_calls[{k}].function.name",
                                 "must match [A-Za-z0-9_-]{1,64}")
        if not isinstance(fn.get("arguments"), (dict, str)):
            raise InvalidMessage(f"{where}.tool_calls[{k}].function.arguments",
                                 "must be an object or JSON text")
        if not _ID.fullmatch(str(call.get("id", "x"))):
            raise InvalidMessage(f"{where}.tool_calls[{k}].id", "must match [A-Za-z0-9_-]{1,64}")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages in the shape a template may see: a list of ``{"role", "content"[,
    "name"]}`` with a known role, and content that is a string, None, or a list of
    ``{"type": "text", "text": str}`` parts (joined); an assistant's may carry
    ``tool_calls`` and a tool's result its ``tool_call_id``. Names and ids are rendered
    as the template's own (trusted) text, so they are held to ``[A-Za-z0-9_-]``.
    Raises :class:`InvalidMessage` naming the field, e.g. ``messages[2].content``.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidMessage("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidMessage(where, f"must be a dict, got {type(m).__name__}")
        allowed = {"role", "content", "name", "tool_calls", "tool_call_id"}
        extra = sorted(set(m) - allowed, key=str)
        if extra:
            raise InvalidMessage(f"{where}.{extra[0]}", "is not a supported message field")
        if "tool_calls" in m:
            _check_calls(m["tool_calls"], where)
        if "tool_call_id" in m and not _ID.fullmatch(str(m["tool_call_id"])):
            raise InvalidMessage(f"{where}.tool_call_id", "must match [A-Za-z0-9_-]{1,64}")
        if m.get("role") not in ROLES:
            raise InvalidMessage(f"{where}.role", f"must be one of {', '.join(ROLES)}, "
                                                  f"got {m.get('role')!r}")
        if "name" in m and not (isinstance(m["name"], str) and _NAME.fullmatch(m["name"])):
            # templates render names as their own (trusted) text: no room for markup
            raise InvalidMessage(f"{where}.name", "must match [A-Za-z0-9_-]{1,64}")
        out.append({**m, "content": _content_text(m.get("content"), where)})
    return out


def _content_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidMessage(f"{where}.content", "must be a string or a list of text parts, "
                                                 f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise InvalidMessage(f"{where}.content[{j}]",
                                 'must be {"type": "text", "text": <string>}')
        texts.append(part["text"])
    return "".join(texts)


# Private-use characters that delimit message content while rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"


def _strip_markers(text: str) -> str:
    return text.replace(_OPEN, "").replace(_CLOSE, "")
