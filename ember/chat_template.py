"""Render a model's Jinja2 chat template into the prompt text.

The environment mirrors the one HuggingFace ``transformers`` renders chat templates
with, since templates are written against it: a sandboxed, immutable Jinja2
environment with ``trim_blocks``, ``lstrip_blocks`` and the loop-controls extension
(``{% break %}``/``{% continue %}``); the ``tojson`` filter dumps JSON without ASCII
escaping or HTML escaping (``indent``, ``separators``, ``sort_keys`` accepted);
globals ``raise_exception(msg)`` (raises ``ChatTemplateError(msg)``) and
``strftime_now(fmt)`` (local time now). Undefined variables render as empty, as in
transformers, so templates may test ``x is defined``.

The rendered text contains control-token strings (``<|im_start|>``...): encode it
with ``Tokenizer.encode(text, parse_special=True)``.

A GGUF without ``tokenizer.chat_template`` (base models, e.g. Gemma 3 270M) makes
``ChatTemplate.from_gguf`` raise ``ChatTemplateError`` unless the caller passes a
``default`` source; ``CHATML_TEMPLATE`` is offered for callers that choose ChatML.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import ChatTemplateError, InvalidMessage

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
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


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
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
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
        marked = [
            {**m, "content": _OPEN + _strip_markers(m["content"]) + _CLOSE}
            if isinstance(m.get("content"), str) else m
            for m in check_messages(messages)
        ]
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


ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages in the shape a template may see: a list of ``{"role", "content"[,
    "name"]}`` with a known role, and content that is a string, None, or a list of
    ``{"type": "text", "text": str}`` parts (joined). Raises :class:`InvalidMessage`
    naming the field, e.g. ``messages[2].content``.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidMessage("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidMessage(where, f"must be a dict, got {type(m).__name__}")
        extra = sorted(set(m) - {"role", "content", "name"}, key=str)
        if extra:
            raise InvalidMessage(f"{where}.{extra[0]}", "is not a supported message field")
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
