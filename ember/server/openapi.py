"""The OpenAPI document: request and response bodies of every route.

Routes read their bodies themselves (size limits, content type and JSON checks come
before any parsing, see :mod:`ember.server.transport`), so FastAPI cannot infer the
request schemas; they are attached here from the protocol models. Responses are
described by the models below, which mirror what :mod:`ember.server.render` writes;
the end-to-end suite runs schemathesis against this document and checks every
response it gets against it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from ember.server import anthropic, embeddings, ollama
from ember.server import protocol as P

_REF = "#/components/schemas/{model}"
BODIES = (P.ChatCompletionRequest, P.CompletionRequest, P.ResponsesRequest,
          P.TokenizeRequest, P.DetokenizeRequest, anthropic.MessagesRequest,
          anthropic.CountTokensRequest, ollama.ChatRequest, ollama.GenerateRequest,
          ollama.ShowRequest, embeddings.EmbeddingsRequest, embeddings.OllamaEmbedRequest,
          embeddings.RerankRequest)


# ---------------------------------------------------------------------- common
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


# ---------------------------------------------------------------------- chat
class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # with a thinking template


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None


# ---------------------------------------------------------------------- completions
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None


# ---------------------------------------------------------------------- responses
class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: str
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: str
    call_id: str
    name: str
    arguments: str


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    status: str
    content: list[ReasoningText]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[OutputMessage | OutputFunctionCall | OutputReasoning]
    usage: ResponseUsage | None
    error: None = None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[Any]
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool
    truncation: str
    user: str | None


# ---------------------------------------------------------------------- others
class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = None  # a LoRA adapter's base model; None for the base itself


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Embedding(BaseModel):
    object: str
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of float32s")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, str] | None = None


class Reranked(BaseModel):
    model: str | None
    object: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class Detokenized(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    model: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


# ---------------------------------------------------------------------- Anthropic
class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class Message(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


# ---------------------------------------------------------------------- Ollama
class OllamaError(BaseModel):
    error: str


class OllamaEmbeddings(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaReply(BaseModel):
    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    message: dict[str, Any] | None = None  # /api/chat
    response: str | None = None  # /api/generate
    thinking: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: dict[str, Any]


class OllamaModels(BaseModel):
    models: list[OllamaModel]


class OllamaShow(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    capabilities: list[str]


class OllamaVersion(BaseModel):
    version: str


class Health(BaseModel):
    status: Literal["ok", "loading", "error"]
    error: str | None = None


def _error(description: str, model: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    return {"model": model, "description": description}


_AUTH = {401: _error("Missing or invalid API key.")}
HEALTH: dict[int | str, Any] = {200: {"model": Health, "description": "Ready."},
                                503: {"model": Health, "description": "Loading or failed."}}
MODELS: dict[int | str, Any] = {
    200: {"model": ModelList, "description": "The base model and the LoRA adapters the "
                                             "caller's tenant may use."}, **_AUTH}
LORA_ADMIN: dict[int | str, Any] = {
    200: {"description": "Done.", "content": {"application/json": {"schema": {
        "type": "object"}}}},
    400: _error("A missing field, or an adapter file that cannot be used (named)."),
    401: _error("Missing or invalid admin API key."),
    403: _error("The server was started without --admin-api-key."),
    404: _error("No such adapter (unload).")}
CACHE_ADMIN: dict[int | str, Any] = {
    200: {"description": "What was removed: the tenant, RAM blocks, disk blocks and bytes.",
          "content": {"application/json": {"schema": {"type": "object"}}}},
    400: _error("No tenant named (?tenant=NAME), or not supported with --replicas."),
    401: _error("Missing or invalid admin API key."),
    403: _error("The server was started without --admin-api-key.")}
TOKENIZER_INFO: dict[int | str, Any] = {
    200: {"model": TokenizerInfo, "description": "The served model's tokenizer."}, **_AUTH,
    503: _error("The model is loading.")}
OLLAMA_MODELS: dict[int | str, Any] = {
    200: {"model": OllamaModels, "description": "The served model."},
    401: _error("Missing or invalid API key.", OllamaError),
    503: _error("The model is loading.", OllamaError)}
OLLAMA_VERSION: dict[int | str, Any] = {
    200: {"model": OllamaVersion, "description": "The Ollama API version these routes follow."}}
METRICS: dict[int | str, Any] = {
    200: {"description": "Prometheus text exposition format.",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    **_AUTH}


# One server-sent event, as clients parse it: its data is a JSON chunk of the route's
# streaming shape (or the final "[DONE]"); Responses events also name their type.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}}}


def route(body: type[BaseModel], response: type[BaseModel], stream: bool = True
          ) -> dict[str, Any]:
    """Keyword arguments for ``app.post`` documenting a route that reads a JSON body
    (a generation route when ``stream``), its errors in its API's shape."""
    assert body in BODIES, body
    error, media = ErrorResponse, "text/event-stream"
    if body.__module__ == anthropic.__name__:
        error = AnthropicError
    elif body.__module__ == ollama.__name__ or body is embeddings.OllamaEmbedRequest:
        error, media = OllamaError, "application/x-ndjson"
    ok: dict[str, Any] = {"model": response, "description": "The result."}
    if stream:
        ok = {"model": response, "description": "The generation; with \"stream\": true, "
              "a stream of events (server-sent events; Ollama's: one JSON object per line).",
              "content": {media: {"schema": _SSE_EVENT if media == "text/event-stream"
                                  else {"type": "string"}}}}
    refusals = {429: _error("The queue is full; retry after Retry-After seconds.", error)} \
        if stream else {}
    return {
        "response_model": None,
        "openapi_extra": {"requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(
                model=body.__name__)}}}}},
        "responses": {
            200: ok,
            400: _error("Invalid request; the message names the field.", error),
            401: _error("Missing or invalid API key.", error),
            404: _error("Unknown model.", error),
            408: _error("The body did not arrive in time.", error),
            413: _error("The body is larger than --max-request-bytes.", error),
            415: _error("The body is not JSON.", error),
            **refusals,
            503: _error("The model is loading or the server is shutting down.", error),
        },
    }


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the request body schemas that :func:`route` refers to."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version,
                              description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for body in BODIES:
                schema = body.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[body.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]

