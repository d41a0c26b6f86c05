"""OpenAI request bodies: parsing, validation, and translation to SamplingParams.

Every field the server understands is declared; any other field, or a declared one
the server cannot honour (tools, logit_bias, audio, ...), is refused with an
:class:`APIError` whose ``param`` names it — nothing is silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ember.sampling.constraints import GrammarError, StructuredOutput
from ember.sampling.params import InvalidSamplingParams, SamplingParams

MAX_N = 16


class APIError(Exception):
    """An error answered as OpenAI does: status, message, type, param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def unsupported(param: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


class _Body(BaseModel):
    # Unknown fields are kept so that they can be refused by name (see reject_extra).
    model_config = ConfigDict(extra="allow")
    _structured: StructuredOutput | None = PrivateAttr(None)  # from response_format

    @property
    def structured(self) -> StructuredOutput | None:
        return self._structured

    def reject_extra(self, where: str = "") -> None:
        for name in (self.model_extra or {}):
            raise unsupported(f"{where}.{name}" if where else name,
                              "is not a recognised parameter")


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def check_common(self) -> None:
        self.reject_extra()
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.stream_options is not None:
            if not self.stream:
                raise APIError(400, "'stream_options' requires 'stream': true",
                               param="stream_options")
            extra = set(self.stream_options) - {"include_usage"}
            if extra:
                raise unsupported(f"stream_options.{sorted(extra)[0]}")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self, max_tokens: int | None, logprobs: int | None,
                 seed_offset: int = 0) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=None if self.seed is None else self.seed + seed_offset,
                stop=list(self.stop or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                structured=self._structured,
            )
        except InvalidSamplingParams as e:
            raise APIError(400, str(e), param=e.param) from None


# ---------------------------------------------------------------------- chat
class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    functions: Any = None
    function_call: Any = None

    def validate_request(self) -> None:
        self.check_common()
        if self.tools and self.tool_choice != "none":
            raise unsupported("tools", "are not supported (only tool_choice 'none')")
        for name in ("audio", "functions", "function_call"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "other than ['text'] are not supported")
        self._structured = structured_output(self.response_format, "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            m.reject_extra(f"messages[{i}]")
            if m.role in ("tool", "function"):
                raise unsupported(f"messages[{i}].role", f"'{m.role}' is not supported")
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": _text_content(m.content, f"messages[{i}]")})
        return out

    @property
    def max_output(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _text_content(content: Any, where: str,
                  text_types: tuple[str, ...] = ("text",)) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in text_types:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise unsupported(f"{where}.content[{j}]", f"of type {kind!r} is not supported "
                              "(text only)")
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"'{where}.content[{j}].text' must be a string",
                           param=f"{where}.content[{j}].text")
        parts.append(text)
    return "".join(parts)


# ---------------------------------------------------------------------- completions
class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    def validate_request(self) -> None:
        self.check_common()
        self._structured = structured_output(self.response_format, "response_format")
        if self.echo:
            raise unsupported("echo")
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of not in (None, 1, self.n):
            raise unsupported("best_of", "other than n is not supported")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- responses
class ResponsesRequest(_Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None

    def validate_request(self) -> None:
        self.reject_extra()
        if self.tools and self.tool_choice != "none":
            raise unsupported("tools", "are not supported (only tool_choice 'none')")
        if self.previous_response_id:
            raise unsupported("previous_response_id", "is not supported (responses are not "
                              "stored; send the conversation as input)")
        if self.store:
            raise unsupported("store", "true is not supported (responses are not stored)")
        if self.reasoning:
            raise unsupported("reasoning")
        if self.text and set(self.text) - {"format"}:
            raise unsupported(f"text.{sorted(set(self.text) - {'format'})[0]}")
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            # the Responses API puts name/schema/strict beside "type", not under json_schema
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                          if k != "type"}}
        self._structured = structured_output(fmt, "text.format")

    def template_messages(self) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if self.instructions:
            msgs.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return msgs + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if item.get("type", "message") != "message":
                raise unsupported(f"{where}.type", f"{item.get('type')!r} items are not "
                                  "supported")
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"'{where}.role' must be system, developer, user or "
                               f"assistant, got {role!r}", param=f"{where}.role")
            content = _text_content(item.get("content"), where,
                                    ("input_text", "output_text", "text"))
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": content})
        if not msgs:
            raise APIError(400, "'input' must not be empty", param="input")
        return msgs

    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=self.max_output_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0, seed=self.seed,
                structured=self._structured)
        except InvalidSamplingParams as e:
            raise APIError(400, str(e), param=e.param) from None


def structured_output(fmt: Any, param: str) -> StructuredOutput | None:
    """The constraint a ``response_format`` / ``text.format`` asks for (None: plain text).

    OpenAI's ``json_object`` and ``json_schema`` (``{"json_schema": {"name", "schema",
    "strict"}}``), plus ember's extensions ``{"type": "regex", "regex": ...}`` and
    ``{"type": "lark", "lark": ...}``.
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise APIError(400, f"'{param}' must be an object with a 'type'", param=param)
    kind = fmt["type"]
    allowed = {"text": {"type"}, "json_object": {"type"},
               "json_schema": {"type", "json_schema"}, "regex": {"type", "regex"},
               "lark": {"type", "lark"}}
    if kind not in allowed:
        raise unsupported(f"{param}.type", f"{kind!r} is not supported (text, json_object, "
                          "json_schema, regex, lark)")
    extra = set(fmt) - allowed[kind]
    if extra:
        raise unsupported(f"{param}.{sorted(extra)[0]}", "is not a recognised field")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise APIError(400, f"'{param}.json_schema.schema' is required",
                               param=f"{param}.json_schema.schema")
            return StructuredOutput.json_schema(spec["schema"])
        value = fmt.get(kind)
        if not isinstance(value, str) or not value:
            raise APIError(400, f"'{param}.{kind}' must be a non-empty string",
                           param=f"{param}.{kind}")
        return StructuredOutput.regex(value) if kind == "regex" else StructuredOutput.lark(value)
    except GrammarError as e:
        raise APIError(400, f"invalid {param}: {e}", param=param) from None


def parse(model: type[_Body], body: Any) -> Any:
    """Validate a JSON body into ``model``; the first problem becomes a 400 naming it."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", param=None)
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_path(err.get("loc", ()))
        raise APIError(400, f"'{param}': {err.get('msg', 'invalid value')}", param=param) \
            from None
    req.validate_request()
    return req


def _param_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "list[dict[str,any]]",
                      "dict[str,any]", "int", "float", "bool", "constrained-str"):
            break  # pydantic's union-branch labels are not part of the path
        elif "[" in str(part) or str(part).startswith("function-"):
            break
        else:
            out += ("." if out else "") + str(part)
    return out
