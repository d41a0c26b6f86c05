"""OpenAI request bodies: parsing, validation, and translation to SamplingParams.

Every field the server understands is declared; any other field, or a declared one
the server cannot honour (logit_bias, audio, a 'function' role, ...), is refused with an
:class:`APIError` whose ``param`` names it — nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ember.sampling.constraints import GrammarError, StructuredOutput
from ember.sampling.params import InvalidSamplingParams, SamplingParams
from ember.server import tools
from ember.server.errors import APIError, unsupported

MAX_N = 16
# (a module name: inside a request class ``tools`` is the field)
FALLBACK_TOOLS = tools.FALLBACK
# reasoning_effort → reasoning tokens allowed (thinking templates only)
EFFORT_BUDGETS = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": 4096}


class _Body(BaseModel):
    # Unknown fields are kept so that they can be refused by name (see reject_extra);
    # the published schema says what that amounts to: no other fields.
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    _structured: StructuredOutput | None = PrivateAttr(None)  # from response_format

    @property
    def structured(self) -> StructuredOutput | None:
        return self._structured

    def reject_extra(self, where: str = "") -> None:
        for name in (self.model_extra or {}):
            raise unsupported(f"{where}.{name}" if where else name,
                              "is not a recognised parameter")


class SLOSpec(BaseModel):
    """Extension ``slo``: this request's latency objectives (the server's by default)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(None, ge=1, le=3_600_000, allow_inf_nan=False,
                                  description="milliseconds to the first token")
    tpot_ms: float | None = Field(None, ge=1, le=3_600_000, allow_inf_nan=False,
                                  description="milliseconds per output token")


class _Request(_Body):
    # extensions: scheduling and speculation
    priority: int | None = Field(None, ge=-1000, le=1000,
                                 description="lower is served first (default 0)")
    slo: SLOSpec | None = None
    speculation: bool = Field(True, description="false: never verify draft tokens "
                              "(the output is the same either way)")
    references: list[str] | None = Field(None, max_length=8, description="texts the reply "
                                         "is likely to quote: drafts may copy from them")

    @field_validator("references")
    @classmethod
    def _references(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and sum(len(t) for t in v) > 1_000_000:
            raise ValueError("at most 1,000,000 characters of references")
        return v


class _Conversation(_Request):
    """A request answered by the assistant of a chat (chat completions and responses):
    it may offer tools and get a reasoning part. What its tools become for the served
    model (a :class:`~ember.server.tools.ToolPlan` in the model's call format) the route
    computes from the body; the body itself stays as the client sent it."""

    _flat_tools: ClassVar[bool] = False  # the Responses API's shape: fields beside "type"

    def tool_plan(self, style: tools.ToolStyle = FALLBACK_TOOLS) -> tools.ToolPlan | None:
        """The tools offered, in the call format ``style`` (the served model's template's);
        None without tools or with ``tool_choice`` none. 400s name the field."""
        plan = tools.plan(getattr(self, "tools", None), getattr(self, "tool_choice", None),
                          getattr(self, "parallel_tool_calls", None), flat=self._flat_tools)
        return None if plan is None else dataclasses.replace(plan, style=style)

    def output_grammar(self, plan: tools.ToolPlan | None) -> StructuredOutput | None:
        """What constrains the reply: the tools' calls, else the requested format."""
        return plan.grammar() if plan is not None else self._structured

    @staticmethod
    def template_variables(plan: tools.ToolPlan | None) -> dict[str, Any]:
        """What the template is given beside the messages: the tools, where it takes them."""
        if plan is None or not plan.style.native:
            return {}
        return {"tools": plan.template_tools()}


class _Sampling(_Request):
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
    # standard fields with nothing to do here: accepted as long as they ask for nothing
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # a hint; the prefix cache needs none
    safety_identifier: str | None = None

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
        check_unstored(self.store, "completions")
        check_service_tier(self.service_tier)
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
                 seed_offset: int = 0, prompt_logprobs: int | None = None,
                 structured: StructuredOutput | None = None) -> SamplingParams:
        """The choice's sampling parameters; ``structured``: what constrains it (default:
        the requested ``response_format``)."""
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
                prompt_logprobs=prompt_logprobs,
                structured=self._structured if structured is None else structured,
                speculation=self.speculation,
            )
        except InvalidSamplingParams as e:
            raise APIError(400, str(e), param=e.param) from None


# ---------------------------------------------------------------------- chat
class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # what ember's (and OpenAI's) replies carry, so that a returned message is valid input
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def check(self, where: str) -> None:
        self.reject_extra(where)
        for name in ("audio", "function_call"):
            if getattr(self, name) is not None:
                raise unsupported(f"{where}.{name}")
        if self.tool_calls and self.role != "assistant":
            raise unsupported(f"{where}.tool_calls", f"on a '{self.role}' message")
        if self.role == "function":
            raise unsupported(f"{where}.role", "'function' is not supported (use 'tool')")


class ChatCompletionRequest(_Sampling, _Conversation):
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
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = Field(None, ge=0)  # extension
    prediction: Any = None
    web_search_options: Any = None
    verbosity: str | None = None

    def validate_request(self) -> None:
        self.check_common()
        plan = tools.plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.reasoning_effort not in (None, *EFFORT_BUDGETS):
            raise APIError(400, f"'reasoning_effort' must be one of "
                           f"{', '.join(EFFORT_BUDGETS)}, got {self.reasoning_effort!r}",
                           param="reasoning_effort")
        for name in ("audio", "functions", "function_call", "prediction",
                     "web_search_options", "verbosity"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "other than ['text'] are not supported")
        self._structured = structured_output(self.response_format, "response_format")
        if plan is not None and self._structured is not None:
            raise unsupported("response_format", "with tools is not supported (use "
                              "tool_choice 'none', or a tool whose parameters are the "
                              "schema)")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")

    def template_messages(self, style: tools.ToolStyle = FALLBACK_TOOLS,
                          plan: tools.ToolPlan | None = None) -> list[dict[str, Any]]:
        """The messages for the chat template: past calls and results as ``style`` (the
        served model's) renders them, and the tools of ``plan`` told in a system message
        where the template cannot take them."""
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            m.check(where)
            content = _text_content(m.content, where)
            if not content and m.refusal:
                content = m.refusal  # what the assistant said, as a refusal
            msg = template_turn(m.role, content, m.tool_calls, m.tool_call_id, where, style)
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return with_tool_offer(out, plan)

    @property
    def thinking_budget(self) -> tuple[int, str] | None:
        """The reasoning budget asked for, and the field that asked."""
        if self.thinking_token_budget is not None:
            return self.thinking_token_budget, "thinking_token_budget"
        if self.reasoning_effort is not None:
            return EFFORT_BUDGETS[self.reasoning_effort], "reasoning_effort"
        return None

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
    if not isinstance(content, list):
        raise APIError(400, f"'{where}.content' must be a string or a list of content parts, "
                       f"got {type(content).__name__}", param=f"{where}.content")
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


def template_turn(role: str, content: str, calls: list[Any] | None, call_id: str | None,
                  where: str, style: tools.ToolStyle) -> dict[str, Any]:
    """One message for the chat template, past calls and results as ``style`` (the served
    model's call format) renders them: natively where the template takes them, else as
    Hermes text (calls in the assistant's turn, results in a user turn)."""
    role = "system" if role == "developer" else role
    if style.native:
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = tools.native_calls(calls, where, style)
        if role == "tool":
            msg["tool_call_id"] = tools.call_id(call_id or "")
        return msg
    if calls:
        content = tools.history_text(content, calls, where)
    if role == "tool":
        role, content = "user", tools.tool_result_text(content)
    return {"role": role, "content": content}


def with_tool_offer(msgs: list[dict[str, Any]], plan: tools.ToolPlan | None
                    ) -> list[dict[str, Any]]:
    """``msgs`` with ``plan``'s tools told in the system message, where the served model's
    template cannot take them itself."""
    if plan is None or plan.style.native:
        return msgs
    offer = plan.system_text()
    if msgs and msgs[0]["role"] == "system":
        return [{**msgs[0], "content": msgs[0]["content"] + "\n\n" + offer}, *msgs[1:]]
    return [{"role": "system", "content": offer}, *msgs]


# ---------------------------------------------------------------------- completions
class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    def validate_request(self) -> None:
        self.check_common()
        self._structured = structured_output(self.response_format, "response_format")
        if self.echo and self.stream:
            raise unsupported("echo", "with stream: true is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "'max_tokens': 0 needs 'echo': true (nothing to return)",
                           param="max_tokens")
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of not in (None, 1, self.n):
            raise unsupported("best_of", "other than n is not supported")

    @property
    def prompt_logprobs(self) -> int | None:
        """With ``echo``, the prompt's tokens get logprobs as the completion's do."""
        return self.logprobs if self.echo else None

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
class ResponsesRequest(_Conversation):
    _flat_tools: ClassVar[bool] = True
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
    include: list[str] | None = None
    truncation: str | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream_options: dict[str, Any] | None = None
    prompt: Any = None
    conversation: Any = None

    @property
    def thinking_budget(self) -> tuple[int, str] | None:
        effort = (self.reasoning or {}).get("effort")
        return None if effort is None else (EFFORT_BUDGETS[effort], "reasoning.effort")

    def validate_request(self) -> None:
        self.reject_extra()
        check_service_tier(self.service_tier)
        if self.include:
            raise unsupported("include[0]", f"{self.include[0]!r} is not supported")
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", f"{self.truncation!r} is not supported "
                              "(only 'disabled')")
        if self.background:
            raise unsupported("background", "true is not supported")
        if self.top_logprobs:
            raise unsupported("top_logprobs")
        for name in ("prompt", "conversation"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.stream_options and set(self.stream_options) - {"include_obfuscation"}:
            raise unsupported(f"stream_options.{sorted(self.stream_options)[0]}")
        plan = self.tool_plan()
        if self.previous_response_id:
            raise unsupported("previous_response_id", "is not supported (responses are not "
                              "stored; send the conversation as input)")
        check_unstored(self.store, "responses")
        if self.reasoning:
            extra = set(self.reasoning) - {"effort", "summary"}
            if extra:
                raise unsupported(f"reasoning.{sorted(extra)[0]}")
            if self.reasoning.get("effort") not in (None, *EFFORT_BUDGETS):
                raise APIError(400, f"'reasoning.effort' must be one of "
                               f"{', '.join(EFFORT_BUDGETS)}", param="reasoning.effort")
            if self.reasoning.get("summary") is not None:
                raise unsupported("reasoning.summary", "is not supported (the reasoning "
                                  "itself is returned)")
        if self.text and set(self.text) - {"format"}:
            raise unsupported(f"text.{sorted(set(self.text) - {'format'})[0]}")
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            # the Responses API puts name/schema/strict beside "type", not under json_schema
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                          if k != "type"}}
        self._structured = structured_output(fmt, "text.format")
        if plan is not None and self._structured is not None:
            raise unsupported("text.format", "with tools is not supported")

    def template_messages(self, plan: tools.ToolPlan | None = None) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if self.instructions:
            msgs.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return msgs + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind in ("function_call", "function_call_output"):
                msgs.append(_function_item(item, where, msgs))
                continue
            if kind != "message":
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
        msgs = [{k: v for k, v in m.items() if k != "calls"} for m in msgs]
        return with_tool_offer(msgs, plan)

    def sampling(self, structured: StructuredOutput | None = None) -> SamplingParams:
        """Its sampling parameters; ``structured``: what constrains the reply (default:
        the requested ``text.format``)."""
        try:
            return SamplingParams(
                max_tokens=self.max_output_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0, seed=self.seed,
                structured=self._structured if structured is None else structured,
                speculation=self.speculation)
        except InvalidSamplingParams as e:
            raise APIError(400, str(e), param=e.param) from None


def _function_item(item: dict[str, Any], where: str, msgs: list[dict[str, Any]]
                   ) -> dict[str, Any]:
    """A Responses ``function_call`` (the assistant's call) or ``function_call_output``
    (its result) input item, as a chat message; consecutive calls share one turn."""
    if item["type"] == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise APIError(400, f"'{where}.output' must be a string", param=f"{where}.output")
        return {"role": "user", "content": tools.tool_result_text(output)}
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str):
        raise APIError(400, f"'{where}.name' must be a string", param=f"{where}.name")
    if not isinstance(arguments, str):
        raise APIError(400, f"'{where}.arguments' must be a JSON string",
                       param=f"{where}.arguments")
    try:
        json.loads(arguments)
    except ValueError:
        raise APIError(400, f"'{where}.arguments' is not JSON",
                       param=f"{where}.arguments") from None
    text = tools.history_text("", [{"function": {"name": name, "arguments": arguments}}],
                              where)
    if msgs and msgs[-1].get("calls"):  # the previous call's turn: append to it
        last = msgs.pop()
        return {**last, "content": last["content"] + "\n" + text}
    return {"role": "assistant", "content": text, "calls": True}


def check_unstored(store: bool | None, what: str) -> None:
    if store:
        raise unsupported("store", f"true is not supported ({what} are not stored)")


def check_service_tier(tier: str | None) -> None:
    if tier not in (None, "auto", "default"):
        raise unsupported("service_tier", f"{tier!r} is not supported (auto, default)")


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


# ---------------------------------------------------------------------- tokenizer routes
class TokenizeRequest(_Body):
    """``POST /tokenize`` in vLLM's shape: a ``prompt``, or chat ``messages`` rendered
    through the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for chat
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def validate_request(self) -> None:
        self.reject_extra()
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'",
                           param="prompt" if self.prompt is not None else "messages")
        if self.messages is not None and self.add_special_tokens:
            raise unsupported("add_special_tokens", "true is not supported with 'messages' "
                              "(the chat template adds them)")

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages or []):
            m.check(f"messages[{i}]")
            out.append({"role": "system" if m.role == "developer" else m.role,
                        "content": _text_content(m.content, f"messages[{i}]") or m.refusal or ""})
        return out


class DetokenizeRequest(_Body):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)

    def validate_request(self) -> None:
        self.reject_extra()
