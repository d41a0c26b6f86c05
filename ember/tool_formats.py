"""How model families write tool calls: one class per wire format, and which one a
chat template teaches its model (:func:`tool_style`).

A format gives the grammar of a reply made of calls (llguidance Lark, each call's
arguments constrained by its tool's JSON schema through ``%json``), the parser of
such a reply, and the text a reply of calls starts with (a streamed reply is held back
while it may still become calls). Which format a model writes is read off its chat
template, as llama.cpp's ``common/chat`` does (:func:`detect`):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per call
  (Qwen 2.5 / 3, Hermes 2 / 3, SmolLM3, and ember's fallback for any template);
- ``llama3_json``: one ``{"name": ..., "parameters": {...}}`` object (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Nemo);
- ``mistral_args``: ``[TOOL_CALLS]name[ARGS]{...}`` per call (Mistral Small 3.2,
  Devstral, Ministral 3);
- ``qwen3_xml``: ``<tool_call><function=name><parameter=p>value</parameter>...``
  (Qwen3-Coder, Qwen 3.5): string values raw, other values JSON; ``glm_xml``: the same
  as ``<tool_call>name<arg_key>p</arg_key><arg_value>value</arg_value>...`` (GLM 4.6 /
  4.7, Ling 3, Laguna, Spark);
- ``nemotron``: ``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>``
  (Nemotron Nano 2); ``apriel``: the same list between ``<tool_calls>`` and
  ``</tool_calls>`` (Apriel 1.5 / 1.6, whose templates add each call's id);
- ``functionary_v3_1``: ``<function=name>{...}</function>`` per call;
- ``functionary_v3_2``: ``>>>name`` then ``{...}`` per call;
- ``deepseek_r1``: ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` and a fenced JSON block
  (DeepSeek R1 as llama.cpp's template writes it);
- ``harmony``: gpt-oss's messages, the call one addressed ``to=functions.name`` on the
  commentary channel, ``<|constrain|>json<|message|>{...}<|call|>``, after any
  analysis (reasoning) messages.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from ember.chat_template import ChatTemplate

Call = tuple[str, Any]  # (tool name, arguments object)


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _text_not_starting_with(lead: str) -> str:
    """A Lark terminal for a text reply: empty, or whose first character after any
    whitespace is not ``lead``'s first (so a reply is either text or calls, decided by
    its first visible character, as the parser and the stream decide it)."""
    return f"TEXT: /(\\s*[^\\s{re.escape(lead[0])}][\\s\\S]*)?/"


@dataclass(frozen=True)
class ToolFormat:
    """Hermes: the default, and ember's fallback for templates that take no tools."""

    name: str = "hermes"
    lead: str = "<tool_call>"  # what a reply of calls starts with
    open: str = "<tool_call>"
    close: str = "</tool_call>"
    # Control tokens of the served vocabulary that the format's fixed texts hold (text,
    # id), set by :func:`with_control_tokens`: a grammar can only admit a control token
    # by reference (its text spelled in ordinary tokens is not it), so such texts are
    # written as references (Mistral's [TOOL_CALLS] and [ARGS] in its own vocabulary).
    control_tokens: tuple[tuple[str, int], ...] = ()

    def lit(self, text: str) -> str:
        """Lark for the fixed text ``text``: a string, with the control tokens in it as
        token references ``<[id]>``."""
        if not self.control_tokens:
            return _lark_string(text)
        ids = dict(self.control_tokens)
        pattern = "|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))
        parts, pos = [], 0
        for m in re.finditer(pattern, text):
            if m.start() > pos:
                parts.append(_lark_string(text[pos:m.start()]))
            parts.append(f"<[{ids[m.group()]}]>")
            pos = m.end()
        if pos < len(text) or not parts:
            parts.append(_lark_string(text[pos:]))
        return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"

    def grammar(self, schemas: dict[str, dict[str, Any]], parallel: bool, auto: bool) -> str:
        """Lark for a reply of calls (``auto``: or text) to the tools ``schemas``
        (name -> the JSON schema of its arguments)."""
        rules = self.call_rules(schemas)
        calls = f"call ({self._between()} call)*" if parallel else "call"
        head = "start: calls | TEXT" if auto else "start: calls"
        lines = [head, f"calls: {self.prefix}{calls}{self.suffix}", *rules]
        if auto:
            lines.append(_text_not_starting_with(self.lead))
        return "\n".join(lines) + "\n"

    separator = "\n"
    prefix = ""  # Lark before the calls (Mistral's list opener)

    def _between(self) -> str:
        """Lark between two calls."""
        return self.lit(self.separator)
    suffix = ""

    def call_rules(self, schemas: dict[str, dict[str, Any]]) -> list[str]:
        schema = _one_of([_named(name, "arguments", s) for name, s in schemas.items()])
        return [f"call: {self.lit(self.open)} body {self.lit(self.close)}",
                f"body: %json {json.dumps(schema)}"]

    def example(self, name: str, arguments: dict[str, str]) -> str:
        """One call as this format writes it (whitespace aside)."""
        return self.open + json.dumps({"name": name, "arguments": arguments}) + self.close

    def shown_in(self, rendered: str, name: str, arguments: dict[str, str]) -> bool:
        """Whether ``rendered`` (whitespace removed) holds the call as this format
        writes it."""
        return re.sub(r"\s+", "", self.example(name, arguments)) in rendered

    reasons = False  # its grammar lets the model reason before it calls (or answers)

    def may_be_calls(self, text: str) -> bool:
        """Whether a reply beginning with ``text`` may still turn out to be calls (a
        streamed reply is held back until it cannot)."""
        head = text.lstrip()
        return not head or head.startswith(self.lead[0])

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]) -> list[Call] | None:
        """The calls of a reply to the tools ``schemas``, or None when it is text (or
        cut short). Text after the last call is ignored (a grammar-built reply has none;
        a template's rendering of a past call goes on with the turn's end)."""
        if not text.lstrip().startswith(self.lead):
            return None
        pattern = re.escape(self.open) + r"\s*(.*?)\s*" + re.escape(self.close)
        return _objects(re.findall(pattern, text, re.S), "arguments")


def _named(name: str, key: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, key: parameters},
            "required": ["name", key], "additionalProperties": False}


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _objects(bodies: list[str], key: str) -> list[Call] | None:
    calls = []
    for body in bodies:
        try:
            call = json.loads(body)
            calls.append((call["name"], call[key]))
        except (ValueError, KeyError, TypeError):
            return None
    return calls or None


@dataclass(frozen=True)
class Llama3Json(ToolFormat):
    """Llama 3.x: the reply is one JSON object naming the function and its
    ``parameters`` (its templates ask for exactly one call)."""

    name: str = "llama3_json"
    lead: str = "{"

    def grammar(self, schemas: dict[str, dict[str, Any]], parallel: bool, auto: bool) -> str:
        return super().grammar(schemas, False, auto)

    def call_rules(self, schemas: dict[str, dict[str, Any]]) -> list[str]:
        schema = _one_of([_named(name, "parameters", s) for name, s in schemas.items()])
        return [f"call: %json {json.dumps(schema)}"]

    def example(self, name: str, arguments: dict[str, str]) -> str:
        return json.dumps({"name": name, "parameters": arguments})

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]) -> list[Call] | None:
        if not text.lstrip().startswith(self.lead):
            return None
        try:
            call, _ = json.JSONDecoder().raw_decode(text.lstrip())
        except ValueError:
            return None
        return _objects([json.dumps(call)], "parameters")


@dataclass(frozen=True)
class MistralList(ToolFormat):
    """Mistral Nemo: ``[TOOL_CALLS]`` then a JSON list of calls (Nemotron Nano 2: the
    list between ``<TOOLCALL>`` and ``</TOOLCALL>``)."""

    name: str = "mistral"
    lead: str = "[TOOL_CALLS]"
    list_close: str = ""  # after the list

    def grammar(self, schemas: dict[str, dict[str, Any]], parallel: bool, auto: bool) -> str:
        calls = {"type": "array", "minItems": 1,
                 "items": _one_of([_named(n, "arguments", s) for n, s in schemas.items()])}
        if not parallel:
            calls["maxItems"] = 1
        head = "start: calls | TEXT" if auto else "start: calls"
        close = f" {self.lit(self.list_close)}" if self.list_close else ""
        lines = [head, f"calls: {self.lit(self.lead)} %json {json.dumps(calls)}{close}"]
        if auto:
            lines.append(_text_not_starting_with(self.lead))
        return "\n".join(lines) + "\n"

    def example(self, name: str, arguments: dict[str, str]) -> str:
        # a prefix: templates append the call's id after its arguments
        return self.lead + "[" + json.dumps({"name": name, "arguments": arguments})[:-1]

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]) -> list[Call] | None:
        stripped = text.lstrip()
        if not stripped.startswith(self.lead):
            return None
        try:
            items, _ = json.JSONDecoder().raw_decode(stripped[len(self.lead):])
            return [(c["name"], c["arguments"]) for c in items] or None
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class MistralArgs(ToolFormat):
    """Mistral Small 3.2 / Devstral / Ministral 3: ``[TOOL_CALLS]name[ARGS]{...}`` for
    each call, one after another."""

    name: str = "mistral_args"
    lead: str = "[TOOL_CALLS]"
    separator = ""

    def example(self, name: str, arguments: dict[str, str]) -> str:
        return f"{self.lead}{name}[ARGS]{json.dumps(arguments)}"

    def shown_in(self, rendered: str, name: str, arguments: dict[str, str]) -> bool:
        # Mistral Small 3.2's templates write the call's id between: [CALL_ID]id
        args = re.escape(re.sub(r"\s+", "", json.dumps(arguments)))
        pattern = re.escape(self.lead + name) + r"(\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]" + args
        return re.search(pattern, rendered) is not None

    def call_rules(self, schemas: dict[str, dict[str, Any]]) -> list[str]:
        alternatives = " | ".join(f"call_{i}" for i in range(len(schemas)))
        rules = [f"call: {alternatives}"]
        for i, (name, schema) in enumerate(schemas.items()):
            rules.append(f"call_{i}: {self.lit(self.lead + name + '[ARGS]')} "
                         f"%json {json.dumps(schema)}")
        return rules

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]) -> list[Call] | None:
        stripped = text.strip()
        if not stripped.startswith(self.lead):
            return None
        calls = []
        decoder = json.JSONDecoder()
        parts = stripped.split(self.lead)[1:]
        for k, part in enumerate(parts):
            name, sep, rest = part.partition("[ARGS]")
            name = name.partition("[CALL_ID]")[0]
            try:
                arguments, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            if not sep or (k < len(parts) - 1 and rest[end:].strip()):
                return None  # text between calls (after the last one ends the reply)
            calls.append((name, arguments))
        return calls or None


@dataclass(frozen=True)
class Qwen3Xml(ToolFormat):
    """Qwen3-Coder / Qwen 3.5: each call an XML-ish block of parameters; a string value
    is written raw, any other value as JSON. The layout is data: GLM's
    ``<tool_call>name<arg_key>p</arg_key><arg_value>v</arg_value></tool_call>`` is the
    same format with other tags (:data:`GLM_XML`)."""

    name: str = "qwen3_xml"
    call_open: str = "<tool_call>\n<function={name}>\n"  # after ``open``'s lead
    call_close: str = "</function>\n</tool_call>"
    param_open: str = "<parameter={param}>\n"
    value_close: str = "\n</parameter>\n"  # after a value ("\n" of it optional in text)
    # parse: a call's name and body, and each (parameter, value) in the body
    call_pattern: str = r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)\s*</function>\s*</tool_call>"
    param_pattern: str = r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>"
    optional_newlines: bool = False  # the layout's newlines may be left out (GLM 4.7's are)

    def _between(self) -> str:
        return self._fixed(self.separator)

    def _fixed(self, text: str) -> str:
        """Lark for a fixed text of the layout."""
        if not self.optional_newlines or "\n" not in text:
            return self.lit(text)
        pieces = [self.lit(p) if p else "" for p in text.split("\n")]
        return "(" + ' "\\n"? '.join(pieces).strip() + ")"

    def example(self, name: str, arguments: dict[str, str]) -> str:
        params = "".join(self.param_open.format(param=k) + v + self.value_close
                         for k, v in arguments.items())
        return self.call_open.format(name=name) + params + self.call_close

    def call_rules(self, schemas: dict[str, dict[str, Any]]) -> list[str]:
        alternatives = " | ".join(f"call_{i}" for i in range(len(schemas)))
        # a raw (string) value: any text without "</" (the schema's other string
        # constraints but enum are not enforced on raw values)
        rules = [f"call: {alternatives}", "RAW: /([^<]|<[^\\/])*/"]
        raw_close = self.value_close.lstrip("\n")  # a raw value keeps its own newlines
        for i, (name, schema) in enumerate(schemas.items()):
            parts = [self._fixed(self.call_open.format(name=name))]
            props = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            for j, (param, sub) in enumerate(props.items()):
                rule = f"p_{i}_{j}"
                if _is_string(sub) and sub.get("enum"):  # raw, but one of the choices
                    choices = " | ".join(_lark_string(str(v)) for v in sub["enum"])
                    value = f"({choices}) {self._fixed(self.value_close)}"
                elif _is_string(sub):
                    value = f"RAW {self._fixed(raw_close)}"
                else:
                    value = f"%json {json.dumps(sub)} {self._fixed(self.value_close)}"
                rules.append(f"{rule}: {self._fixed(self.param_open.format(param=param))} "
                             f"{value}")
                parts.append(rule if param in required else f"{rule}?")
            parts.append(self._fixed(self.call_close))
            rules.append(f"call_{i}: " + " ".join(parts))
        return rules

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]) -> list[Call] | None:
        if not text.lstrip().startswith(self.lead):
            return None
        calls = []
        for name, body in re.findall(self.call_pattern, text, re.S):
            name = name.strip()
            if name not in schemas:
                return None
            props = schemas[name].get("properties") or {}
            arguments: dict[str, Any] = {}
            for param, raw in re.findall(self.param_pattern, body, re.S):
                if _is_string(props.get(param, {})):
                    arguments[param] = raw
                    continue
                try:
                    arguments[param] = json.loads(raw)
                except ValueError:
                    return None
            calls.append((name, arguments))
        return calls or None


# GLM 4.6 / 4.7, Ling 3, Laguna, Spark: parameters as key and value elements
GLM_XML = Qwen3Xml(
    name="glm_xml", call_open="<tool_call>{name}\n", call_close="</tool_call>",
    param_open="<arg_key>{param}</arg_key>\n<arg_value>", value_close="</arg_value>\n",
    call_pattern=r"<tool_call>([^<\n]+)\n?(.*?)</tool_call>",
    param_pattern=r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>",
    optional_newlines=True)


@dataclass(frozen=True)
class NamedJson(ToolFormat):
    """Each call the function's name, then its arguments as one JSON object, between
    fixed texts; the calls may sit inside a section of their own (DeepSeek R1)."""

    name: str = "functionary_v3_1"
    lead: str = "<function="
    open: str = "<function="  # before a call's name
    mid: str = ">"  # between the name and the arguments
    close: str = "</function>"  # after the arguments
    calls_open: str = ""  # before the calls
    calls_close: str = ""  # after them
    separator: str = ""

    def grammar(self, schemas: dict[str, dict[str, Any]], parallel: bool, auto: bool) -> str:
        calls = f"call ({self.lit(self.separator)} call)*" if parallel else "call"
        head = "start: calls | TEXT" if auto else "start: calls"
        opener = f"{self.lit(self.calls_open)} " if self.calls_open else ""
        closer = f" {self.lit(self.calls_close)}" if self.calls_close else ""
        lines = [head, f"calls: {opener}{calls}{closer}", *self.call_rules(schemas)]
        if auto:
            lines.append(_text_not_starting_with(self.lead))
        return "\n".join(lines) + "\n"

    def call_rules(self, schemas: dict[str, dict[str, Any]]) -> list[str]:
        alternatives = " | ".join(f"call_{i}" for i in range(len(schemas)))
        rules = [f"call: {alternatives}"]
        for i, (name, schema) in enumerate(schemas.items()):
            close = f" {self.lit(self.close)}" if self.close else ""
            rules.append(f"call_{i}: {self.lit(self.open + name + self.mid)} "
                         f"%json {json.dumps(schema)}{close}")
        return rules

    def example(self, name: str, arguments: dict[str, str]) -> str:
        return (self.calls_open + self.open + name + self.mid + json.dumps(arguments)
                + self.close)

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]) -> list[Call] | None:
        body = text.lstrip()
        if not body.startswith(self.lead):
            return None
        calls, decoder = [], json.JSONDecoder()
        for m in re.finditer(re.escape(self.open) + r"([^\s<>]+)" + re.escape(self.mid), body):
            rest = body[m.end():].lstrip()
            try:
                arguments, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            if not rest[end:].lstrip().startswith(self.close.strip()):
                return None
            calls.append((m.group(1), arguments))
        return calls or None


FUNCTIONARY_V3_1 = NamedJson()  # the class's defaults
# functionary v3.2: ">>>name" on its own line, then the arguments
FUNCTIONARY_V3_2 = NamedJson(name="functionary_v3_2", lead=">>>", open=">>>", mid="\n",
                             close="")
# DeepSeek R1 (llama.cpp's template): a section of calls, each a fenced JSON block
DEEPSEEK_R1 = NamedJson(
    name="deepseek_r1", lead="<｜tool▁calls▁begin｜>",
    open="<｜tool▁call▁begin｜>function<｜tool▁sep｜>", mid="\n```json\n",
    close="\n```<｜tool▁call▁end｜>", calls_open="<｜tool▁calls▁begin｜>",
    calls_close="<｜tool▁calls▁end｜>", separator="\n")


@dataclass(frozen=True)
class Harmony(ToolFormat):
    """gpt-oss's harmony format. The prompt ends with ``<|start|>assistant``; the reply
    is an analysis (reasoning) message, ``<|channel|>analysis<|message|>text<|end|>
    <|start|>assistant``, if the model reasons (one: a thinking budget bounds it; no
    commentary preambles, which llama.cpp also accepts), then either the answer
    (``<|channel|>final<|message|>text``) or one call, whose recipient sits in the
    channel header (``<|channel|>commentary to=functions.NAME <|constrain|>json``, how
    the model writes it) or in the role header (`` to=functions.NAME<|channel|>
    commentary json``, how the template writes past calls), then ``<|message|>``, the
    arguments and ``<|call|>``, which ends the turn: one call per reply, never
    parallel. The message texts can hold no control token, so a message ends only at
    the token that ends it."""

    name: str = "harmony"
    lead: str = "to=functions."  # what every call holds (a reply starts with a channel)
    reasons = True

    def grammar(self, schemas: dict[str, dict[str, Any]], parallel: bool, auto: bool) -> str:
        # every fixed text a lexeme of its own: llguidance's lexemes are greedy, so a
        # longer literal sharing a start ("<|channel|>commentary<|message|>") would
        # shadow "<|channel|>" "commentary" " to=..."
        channel, message, end = (self.lit(t) for t in ("<|channel|>", "<|message|>",
                                                       "<|end|>"))
        lines = ["start: analysis? reply",
                 "reply: call | final" if auto else "reply: call",
                 f"analysis: {channel} {self.lit('analysis')} {message} to_end "
                 f"{self.lit('<|start|>')} {self.lit('assistant')}",
                 f"final: {channel} {self.lit('final')} {message} TEXT",
                 "TEXT: /(.|\\n)*/",
                 # a message up to its end: a control token ends a greedy text (which
                 # cannot hold it); as text (gpt-oss makes "<|end|>" user-defined) the
                 # message is lazy, ending at the first "<|end|>"
                 f"to_end: TEXT {end}" if end.startswith("<[")
                 else "to_end[lazy]: /(.|\\n)*<\\|end\\|>/",
                 f"channel: {channel} ({self.lit('commentary')} | {self.lit('analysis')})",
                 f"constrain: {self.lit(' ')} {self.lit('<|constrain|>')}? {self.lit('json')}",
                 *self.call_rules(schemas)]
        return "\n".join(lines) + "\n"

    def call_rules(self, schemas: dict[str, dict[str, Any]]) -> list[str]:
        rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
        for i, (name, schema) in enumerate(schemas.items()):
            to = self.lit(f" to=functions.{name}")
            rules.append(f"call_{i}: (channel {to} | {to} channel) constrain? "
                         f"{self.lit('<|message|>')} %json {json.dumps(schema)} "
                         f"{self.lit('<|call|>')}")
        return rules

    def example(self, name: str, arguments: dict[str, str]) -> str:
        return (f"<|start|>assistant to=functions.{name}<|channel|>commentary json"
                f"<|message|>{json.dumps(arguments)}<|call|>")

    def may_be_calls(self, text: str) -> bool:
        return "<|channel|>final<|message|>" not in text

    _HEADER = re.compile(r"\s*(?:<\|channel\|>(?:commentary|analysis)\s*)?to=functions\."
                         r"([^\s<]+)\s*(?:<\|channel\|>(?:commentary|analysis))?\s*"
                         r"(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>")

    def parse(self, text: str, schemas: dict[str, dict[str, Any]]) -> list[Call] | None:
        last = text.rsplit("<|start|>assistant", 1)[-1]  # the call is the last message
        m = self._HEADER.match(last)
        if m is None:
            return None
        try:
            arguments, _ = json.JSONDecoder().raw_decode(last[m.end():])
        except ValueError:
            return None
        return [(m.group(1), arguments)]


def _is_string(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "string"


HERMES = ToolFormat()
FORMATS = {f.name: f for f in (
    HERMES, Llama3Json(), MistralList(),
    MistralList(name="nemotron", lead="<TOOLCALL>", list_close="</TOOLCALL>"),
    MistralList(name="apriel", lead="<tool_calls>", list_close="</tool_calls>"),
    MistralArgs(), Qwen3Xml(), GLM_XML, FUNCTIONARY_V3_1, FUNCTIONARY_V3_2, DEEPSEEK_R1, Harmony())}


def detect(past_call: str, name: str, arguments: dict[str, str]) -> ToolFormat | None:
    """The format of the call ``name(arguments)`` in ``past_call``, a template's
    rendering of it in the history (whitespace ignored): the format the template
    teaches its model; None when it is none ember knows (ember then describes the
    tools itself, in Hermes). Reading the rendering, not the template's source, keeps
    look-alikes apart (GLM's ``<tool_call>name<arg_key>`` is not Hermes)."""
    seen = re.sub(r"\s+", "", past_call)
    return next((f for f in FORMATS.values() if f.shown_in(seen, name, arguments)), None)


@dataclass(frozen=True)
class ToolStyle:
    """How a model takes tools: natively through its template in ``fmt``, or (native
    False) described by ember in Hermes."""

    fmt: ToolFormat = HERMES
    native: bool = False
    object_arguments: bool = True  # the template wants calls' arguments as objects


FALLBACK = ToolStyle()


def tool_style(template: ChatTemplate | None, tokenizer: Any = None) -> ToolStyle:
    """The template's way with tools: native when it takes tools and its rendering of a
    past call is in a format above; else ember's Hermes fallback. With the served
    ``tokenizer``, the format's control tokens are found (:func:`with_control_tokens`)."""
    style = FALLBACK
    if template is not None and template.caps.tools:
        past = template.past_call_text()
        fmt = None if past is None else detect(past, *template.PROBE_CALL)
        if fmt is not None:
            style = ToolStyle(fmt, True, template.caps.object_arguments)
    if tokenizer is None:
        return style
    return dataclasses.replace(style, fmt=with_control_tokens(style.fmt, tokenizer))


def with_control_tokens(fmt: ToolFormat, tokenizer: Any) -> ToolFormat:
    """``fmt`` with the control tokens of ``tokenizer`` that its fixed texts hold (read
    off a grammar of one call, where every fixed text appears)."""
    source = fmt.grammar({"f": {"type": "object"}}, parallel=True, auto=True)
    found = tuple((tokenizer.id_to_piece(i), i) for i in range(tokenizer.vocab_size)
                  if tokenizer.is_control(i) and len(tokenizer.id_to_piece(i)) > 1
                  and tokenizer.id_to_piece(i) in source)
    return dataclasses.replace(fmt, control_tokens=found) if found else fmt
