"""The OpenAI-compatible HTTP server: routes, auth, streaming, overload, cancellation.

The event loop never touches the model: each generation is handed to the
:class:`EngineThread` and its outputs come back through ``call_soon_threadsafe``
into an asyncio queue. A client that disconnects (streaming or not) has its request
aborted, which frees its KV blocks at the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ember.config import EngineConfig
from ember.engine.engine import InvalidRequest, LLMEngine, QueueFull, RequestOutput
from ember.engine.thread import EngineStopped, EngineThread
from ember.errors import EmberError
from ember.sampling.constraints import GrammarError, StructuredOutput
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import TokenLogprobs
from ember.server import protocol as P
from ember.server.metrics import Metrics

log = logging.getLogger("ember.server")
DEFAULT_TENANT = "default"
RETRY_AFTER_SECONDS = 1


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    served_model_name: str | None = None


def load_api_keys(keys: list[str], keys_file: Path | None) -> dict[str, str]:
    """``--api-key K`` (tenant derived from the key) and a file of ``KEY [TENANT]`` lines."""
    out = {k: _tenant_of(k) for k in keys}
    if keys_file is not None:
        for n, line in enumerate(keys_file.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise EmberError(f"{keys_file}:{n}: expected 'KEY [TENANT]', got {line!r}")
            out[parts[0]] = parts[1] if len(parts) == 2 else _tenant_of(parts[0])
    return out


def _tenant_of(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class Server:
    """The engine (loaded in the background) plus everything routes share."""

    def __init__(self, config: ServerConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.thread: EngineThread | None = None
        self.load_error: str | None = None
        self.metrics = Metrics(self._engine_stats)
        self._engine = engine

    # ------------------------------------------------------------ lifecycle
    def start_loading(self) -> threading.Thread:
        t = threading.Thread(target=self._load, name="ember-load", daemon=True)
        t.start()
        return t

    def _load(self) -> None:
        try:
            engine = self._engine or LLMEngine(self.config.engine)
            self.thread = EngineThread(engine).start()
            log.info("model %s loaded in %.2fs", engine.loaded.name, engine.loaded.load_seconds)
        except Exception as e:
            log.exception("loading the model failed")
            self.load_error = str(e)

    @property
    def ready(self) -> bool:
        return self.thread is not None and self.thread.alive

    @property
    def engine(self) -> LLMEngine:
        if not self.ready:
            raise P.APIError(503, self.load_error or "the model is still loading",
                             type="server_error", code="model_not_ready")
        assert self.thread is not None
        return self.thread.engine

    def model_names(self) -> list[str]:
        engine = self.engine
        names = [self.config.served_model_name or engine.loaded.name]
        return names + [n for n in (engine.loaded.name, str(engine.loaded.path)) if n not in names]

    def abort_all(self) -> None:
        """Abort every in-flight generation (the end of a graceful shutdown)."""
        if self.thread is not None:
            self.thread.abort_all()

    def _engine_stats(self) -> dict[str, Any]:
        return self.thread.engine.metrics() if self.thread else {}

    # ------------------------------------------------------------ requests
    def tenant(self, request: Request) -> str:
        keys = self.config.api_keys
        if not keys:
            return DEFAULT_TENANT
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise P.APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
        tenant = keys.get(token.strip())
        if tenant is None:
            raise P.APIError(401, "invalid API key", code="invalid_api_key")
        return tenant

    def check_model(self, model: str) -> None:
        if model not in self.model_names():
            raise P.APIError(404, f"the model '{model}' does not exist; this server serves "
                             f"'{self.model_names()[0]}'", param="model", code="model_not_found")

    async def check_grammar(self, spec: StructuredOutput | None, param: str) -> None:
        """Compile the request's grammar now (cached), so a bad one is a 400 up front."""
        if spec is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammars.compile, spec)
        except GrammarError as e:
            raise P.APIError(400, f"invalid {param}: {e}", param=param) from None

    async def generate(self, prompt_ids: list[int], params: list[SamplingParams], tenant: str,
                       request: Request, max_tokens_param: str = "max_tokens"
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(choice_index, output)`` for ``len(params)`` choices of one prompt.

        Choice 0 is submitted first; the others follow once it has produced its first
        token, by which time the prompt's full blocks are in the prefix cache, so the
        siblings reuse them instead of recomputing the prompt. ``max_tokens_param`` is
        the request's own name for the output cap, which errors about it then name.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        thread = self.thread
        assert thread is not None
        ids: dict[int, str] = {}
        open_choices: set[int] = set()

        async def submit(i: int) -> None:
            def deliver(out: RequestOutput, i: int = i) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (i, out))

            ids[i] = await asyncio.to_thread(thread.submit, prompt_ids, params[i], deliver,
                                             tenant=tenant)
            open_choices.add(i)

        timings = {i: _Timing() for i in range(len(params))}
        latest: dict[int, RequestOutput] = {}
        try:
            await self._guard(submit(0), max_tokens_param)
            pending_siblings = len(params) > 1
            while open_choices:
                i, out = await self._next(queue, request)
                timings[i].seen(out)
                latest[i] = out
                if out.finished:
                    open_choices.discard(i)
                    self._observe(timings[i], out)
                yield i, out
                if pending_siblings:
                    pending_siblings = False
                    for j in range(1, len(params)):
                        await self._guard(submit(j), max_tokens_param)
        finally:
            for i in open_choices:  # the client went away (or the server failed)
                thread.abort(ids[i])
                done = latest[i].completion_tokens if i in latest else 0
                self.metrics.observe_request(timings[i].ttft, timings[i].itls,
                                             time.monotonic() - timings[i].start,
                                             len(prompt_ids), done, "abort")

    async def _guard(self, coro: Any, max_tokens_param: str = "max_tokens") -> None:
        try:
            await coro
        except QueueFull as e:
            raise P.APIError(429, f"server overloaded: {e}; retry later", type="rate_limit_error",
                             code="queue_full",
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except InvalidRequest as e:
            if e.param == "max_tokens" and max_tokens_param != "max_tokens":
                raise P.APIError(400, str(e).replace("max_tokens (", f"{max_tokens_param} ("),
                                 param=max_tokens_param) from None
            raise P.APIError(400, str(e), param=e.param) from None
        except EngineStopped as e:
            raise P.APIError(503, str(e), type="server_error", code="shutting_down") from None

    @staticmethod
    async def _next(queue: asyncio.Queue, request: Request) -> tuple[int, RequestOutput]:
        """Next output; notices a client that went away while we wait."""
        getter = asyncio.ensure_future(queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=0.25)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    raise ClientGone()
        finally:
            getter.cancel()

    def _observe(self, t: _Timing, out: RequestOutput) -> None:
        self.metrics.observe_request(t.ttft, t.itls, time.monotonic() - t.start,
                                     out.prompt_tokens, out.completion_tokens,
                                     out.finish_reason or "error")


class ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


@dataclass
class _Timing:
    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    itls: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def seen(self, out: RequestOutput) -> None:
        if not out.delta_token_ids:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.itls.append(now - self.last)
        self.last = now


# ====================================================================== the app
def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="ember", version="0.1.0",
                  description="OpenAI-compatible server for GGUF models")
    app.state.server = server

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError) -> JSONResponse:
        server.metrics.count_http(request.url.path, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return await _api_error(request, P.APIError(400, f"invalid request: {e.errors()[0]}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return await _api_error(request, P.APIError(500, f"internal error: {e}",
                                                    type="server_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if server.ready:
            return JSONResponse({"status": "ok"})
        status = "error" if server.load_error else "loading"
        return JSONResponse({"status": status, "error": server.load_error}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.tenant(request)
        created = int(time.time())
        data = [{"id": n, "object": "model", "created": created, "owned_by": "ember"}
                for n in server.model_names()[:1]]
        return JSONResponse({"object": "list", "data": data})

    async def admit(request: Request, body: type[P._Body], grammar_param: str
                    ) -> tuple[str, Any, Any]:
        """Auth, parse, model and grammar checks shared by the generation routes."""
        tenant = server.tenant(request)
        req = P.parse(body, await _json(request))
        server.check_model(req.model)
        await server.check_grammar(req.structured, grammar_param)
        return tenant, req, server.engine.loaded

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        tenant, req, loaded = await admit(request, P.ChatCompletionRequest, "response_format")
        prompt_ids = _chat_ids(loaded, req.template_messages())
        params = [req.sampling(req.max_output, req.n_logprobs, j) for j in range(req.n)]
        cap = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        stream = server.generate(prompt_ids, params, tenant, request, cap)
        ids = _Ids("chatcmpl")
        if req.stream:
            return await _sse(request, server, _chat_chunks(stream, req, ids, loaded.tokenizer))
        outs = await _collect(stream, req.n)
        return _ok(request, server, _chat_body(outs, req, ids, loaded.tokenizer))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant, req, loaded = await admit(request, P.CompletionRequest, "response_format")
        prompts = [loaded.encode_prompt(p) for p in req.prompts()]
        if req.stream and len(prompts) > 1:
            raise P.unsupported("prompt", "as a batch is not supported with stream: true")
        params = [req.sampling(req.max_tokens, req.logprobs, j) for j in range(req.n)]
        ids = _Ids("cmpl")
        if req.stream:
            stream = server.generate(prompts[0], params, tenant, request)
            return await _sse(request, server, _completion_chunks(stream, req, ids,
                                                                  loaded.tokenizer))
        all_outs = []
        for p in prompts:
            all_outs.append(await _collect(server.generate(p, params, tenant, request), req.n))
        return _ok(request, server, _completion_body(all_outs, req, ids, loaded.tokenizer))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        tenant, req, loaded = await admit(request, P.ResponsesRequest, "text.format")
        prompt_ids = _chat_ids(loaded, req.template_messages())
        stream = server.generate(prompt_ids, [req.sampling()], tenant, request,
                                 "max_output_tokens")
        ids = _Ids("resp")
        if req.stream:
            return await _sse(request, server, _response_events(stream, req, ids))
        out = (await _collect(stream, 1))[0]
        return _ok(request, server, _response_body(req, ids, out, "completed"))

    return app


# ---------------------------------------------------------------------- helpers
async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"malformed JSON body: {e}") from None


def _chat_ids(loaded: Any, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return loaded.encode_chat(messages)
    except EmberError as e:
        raise P.APIError(400, f"cannot apply the chat template: {e}", param="messages") from None


def _ok(request: Request, server: Server, body: dict[str, Any]) -> JSONResponse:
    server.metrics.count_http(request.url.path, 200)
    return JSONResponse(body)


async def _collect(stream: AsyncIterator[tuple[int, RequestOutput]], n: int) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    try:
        async for i, out in stream:
            if out.finished:
                final[i] = out
    except ClientGone:
        raise P.APIError(499, "client closed the request") from None
    for out in final.values():
        if out.finish_reason == "error":
            raise P.APIError(500, f"generation failed: {out.error}", type="server_error")
    return [final[i] for i in range(n)]


async def _sse(request: Request, server: Server, events: AsyncIterator[str]) -> Response:
    """Start streaming only once the first event exists, so that errors raised before
    any token (queue full, bad request) are answered as plain JSON with their status."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = ""

    async def body() -> AsyncIterator[str]:
        try:
            yield first
            async for event in events:
                yield event
        except (ClientGone, asyncio.CancelledError):
            pass
        except P.APIError as e:  # mid-stream failure: say so in-band, then end
            yield _data(e.body())
        finally:
            await events.aclose()

    server.metrics.count_http(request.url.path, 200)
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Ids:
    def __init__(self, prefix: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())


def _chunk_writer(ids: _Ids, req: Any, object_name: str) -> Callable[..., str]:
    """SSE ``data:`` events of one streamed response; usage only if the client asked."""

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> str:
        body = {"id": ids.id, "object": object_name, "created": ids.created,
                "model": req.model, "system_fingerprint": None, "choices": choices}
        if req.include_usage:
            body["usage"] = usage
        return _data(body)

    return chunk


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = outs[0].prompt_tokens if outs else 0
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens if outs else 0}}


def _token_text(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _chat_logprobs(lps: list[TokenLogprobs] | None, tokenizer: Any) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        text, raw = _token_text(tokenizer, lp.token)
        top = []
        for t, v in lp.top:
            ttext, traw = _token_text(tokenizer, t)
            top.append({"token": ttext, "logprob": v, "bytes": traw})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def _completion_logprobs(lps: list[TokenLogprobs] | None, tokenizer: Any,
                         offset: int = 0) -> dict[str, Any] | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = _token_text(tokenizer, lp.token)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({_token_text(tokenizer, t)[0]: v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_body(outs: list[RequestOutput], req: P.ChatCompletionRequest, ids: _Ids,
               tokenizer: Any) -> dict[str, Any]:
    choices = [{
        "index": i,
        "message": {"role": "assistant", "content": o.text, "refusal": None},
        "logprobs": _chat_logprobs(o.logprobs, tokenizer),
        "finish_reason": o.finish_reason,
    } for i, o in enumerate(outs)]
    return {"id": ids.id, "object": "chat.completion", "created": ids.created,
            "model": req.model, "choices": choices, "usage": _usage(outs),
            "system_fingerprint": None}


async def _chat_chunks(stream: AsyncIterator[tuple[int, RequestOutput]],
                       req: P.ChatCompletionRequest, ids: _Ids, tokenizer: Any
                       ) -> AsyncIterator[str]:
    chunk = _chunk_writer(ids, req, "chat.completion.chunk")

    started: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    async for i, out in stream:
        if i not in started:
            started.add(i)
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        if out.delta_text or out.delta_token_ids:
            yield chunk([{"index": i, "delta": {"content": out.delta_text},
                          "logprobs": _chat_logprobs(out.delta_logprobs, tokenizer),
                          "finish_reason": None}])
        if out.finished:
            if out.finish_reason == "error":
                raise P.APIError(500, f"generation failed: {out.error}", type="server_error")
            finals[i] = out
            yield chunk([{"index": i, "delta": {}, "logprobs": None,
                          "finish_reason": out.finish_reason}])
    if req.include_usage:
        yield chunk([], _usage([finals[i] for i in sorted(finals)]))
    yield "data: [DONE]\n\n"


def _completion_body(all_outs: list[list[RequestOutput]], req: P.CompletionRequest, ids: _Ids,
                     tokenizer: Any) -> dict[str, Any]:
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    for p, outs in enumerate(all_outs):
        for j, o in enumerate(outs):
            choices.append({"index": p * req.n + j, "text": o.text,
                            "logprobs": _completion_logprobs(o.logprobs, tokenizer),
                            "finish_reason": o.finish_reason})
        u = _usage(outs)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[k] += u[k]
        usage["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"][
            "cached_tokens"]
    return {"id": ids.id, "object": "text_completion", "created": ids.created,
            "model": req.model, "choices": choices, "usage": usage, "system_fingerprint": None}


async def _completion_chunks(stream: AsyncIterator[tuple[int, RequestOutput]],
                             req: P.CompletionRequest, ids: _Ids, tokenizer: Any
                             ) -> AsyncIterator[str]:
    chunk = _chunk_writer(ids, req, "text_completion")

    finals: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}
    async for i, out in stream:
        if out.delta_text or out.delta_token_ids:
            lp = _completion_logprobs(out.delta_logprobs, tokenizer, offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + len(out.delta_text)
            yield chunk([{"index": i, "text": out.delta_text, "logprobs": lp,
                          "finish_reason": None}])
        if out.finished:
            if out.finish_reason == "error":
                raise P.APIError(500, f"generation failed: {out.error}", type="server_error")
            finals[i] = out
            yield chunk([{"index": i, "text": "", "logprobs": None,
                          "finish_reason": out.finish_reason}])
    if req.include_usage:
        yield chunk([], _usage([finals[i] for i in sorted(finals)]))
    yield "data: [DONE]\n\n"


def _response_body(req: P.ResponsesRequest, ids: _Ids, out: RequestOutput | None,
                   status: str, msg_id: str | None = None) -> dict[str, Any]:
    text = out.text if out else ""
    done = out is not None and out.finished
    if done and out.finish_reason == "length":
        status = "incomplete"
    item = {"id": msg_id or f"msg_{ids.id[5:]}", "type": "message", "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if done else []}
    usage = None
    if done:
        usage = {"input_tokens": out.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": out.cached_tokens},
                 "output_tokens": out.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": out.prompt_tokens + out.completion_tokens}
    return {
        "id": ids.id.replace("resp-", "resp_"), "object": "response",
        "created_at": ids.created, "status": status, "model": req.model,
        "output": [item] if done else [],
        "usage": usage, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "parallel_tool_calls": False, "tool_choice": req.tool_choice or "none", "tools": [],
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "metadata": req.metadata or {},
        "store": False, "truncation": "disabled", "user": req.user,
    }


async def _response_events(stream: AsyncIterator[tuple[int, RequestOutput]],
                           req: P.ResponsesRequest, ids: _Ids) -> AsyncIterator[str]:
    seq = iter(range(1 << 30))
    msg_id = f"msg_{ids.id[5:]}"

    def event(kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": next(seq), **payload}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    first = await stream.__anext__()  # admission errors surface before any event
    in_progress = _response_body(req, ids, None, "in_progress", msg_id)
    yield event("response.created", response=in_progress)
    yield event("response.in_progress", response=in_progress)
    part_ref = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    yield event("response.output_item.added", output_index=0,
                item={"id": msg_id, "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []})
    yield event("response.content_part.added", **part_ref,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    final = None

    async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
        yield first
        async for item in stream:
            yield item

    async for _, out in outputs():
        if out.delta_text:
            yield event("response.output_text.delta", **part_ref, delta=out.delta_text,
                        logprobs=[])
        if out.finished:
            final = out
    assert final is not None
    if final.finish_reason == "error":
        raise P.APIError(500, f"generation failed: {final.error}", type="server_error")
    done = _response_body(req, ids, final, "completed", msg_id)
    part = done["output"][0]["content"][0]
    yield event("response.output_text.done", **part_ref, text=final.text, logprobs=[])
    yield event("response.content_part.done", **part_ref, part=part)
    yield event("response.output_item.done", output_index=0, item=done["output"][0])
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    yield event(kind, response=done)


SHUTDOWN_FLUSH_SECONDS = 2.0


def run_server(config: ServerConfig, host: str, port: int, graceful_seconds: float = 10.0,
               on_ready: Callable[[str], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; then stop accepting, let in-flight requests finish for
    up to ``graceful_seconds``, abort the rest (their responses still end properly: a
    stream gets its finish chunk and ``[DONE]``), and return 0."""
    import uvicorn

    server = Server(config)
    server.start_loading()
    app = create_app(server)
    # uvicorn cancels whatever is still running after its own timeout; ember aborts the
    # generations first, at ``graceful_seconds``, and leaves uvicorn time to flush them.
    uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                               timeout_graceful_shutdown=graceful_seconds
                               + SHUTDOWN_FLUSH_SECONDS)
    uv = _uvicorn_server(uvicorn.Server, uv_config, graceful_seconds, server.abort_all)
    print(f"ember: listening on http://{host}:{port}/v1 (model loading; GET /health)",
          flush=True)
    if on_ready:
        on_ready(f"http://{host}:{port}")
    uv.run()
    if server.thread is not None:
        server.thread.drain(timeout=graceful_seconds)
        server.thread.shutdown(timeout=graceful_seconds)
    print("ember: stopped", flush=True)
    return 0


def _uvicorn_server(base: type, config: Any, graceful_seconds: float,
                    abort_all: Callable[[], None]) -> Any:
    """A ``uvicorn.Server`` that (1) aborts the in-flight generations once the graceful
    period is over, and (2) does not re-raise the SIGINT/SIGTERM it caught.

    uvicorn (>= 0.29) re-raises the signal after its own shutdown, which kills the
    process by that signal before :func:`run_server` drains the engine: ``ember serve``
    would die with -SIGTERM instead of finishing its graceful shutdown with status 0.
    """
    import signal

    class EmberUvicornServer(base):  # type: ignore[misc, valid-type]
        async def shutdown(self, sockets: Any = None) -> None:
            asyncio.get_running_loop().call_later(graceful_seconds, abort_all)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return EmberUvicornServer(config)
