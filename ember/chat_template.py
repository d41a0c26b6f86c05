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
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import ChatTemplateError

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
        """
        marked = [
            {**m, "content": _OPEN + _strip_markers(m["content"]) + _CLOSE}
            if isinstance(m.get("content"), str) else m
            for m in messages
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


# Private-use characters that delimit message content while rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"


def _strip_markers(text: str) -> str:
    return text.replace(_OPEN, "").replace(_CLOSE, "")
