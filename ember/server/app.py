"""The HTTP server: the ``Server`` every route shares, admission, and ``create_app``'s
routes — OpenAI's API, and Anthropic's and Ollama's over the same path (anthropic.py,
ollama.py translate their bodies and replies), and embeddings (embeddings.py), run on
the engine thread beside generation. Beside it: who a request is (auth.py), the
served adapters (adapters.py), the routes' prompts (routes.py), a request's outputs
(generation.py), running it (run.py).

A generation request goes through the same steps on every route:

1. on the event loop, only cheap checks: the API key (compared in constant time),
   the content type, the body size and read deadline (:mod:`ember.server.transport`)
   and a place in the engine's queue (429 at once when it is full);
2. in a small pool of preparation threads, everything that costs CPU in proportion
   to the input: JSON decoding, validation, a bound on the prompt's length from its
   character count (a huge prompt is refused before it is tokenized), the chat
   template, tokenization, and the engine's own ``prepare`` (grammar compilation);
3. a non-blocking hand-over to the :class:`EngineThread`; outputs come back through
   ``call_soon_threadsafe`` into an asyncio queue.

A client that disconnects, at any point, has its requests aborted at the next
engine step (their KV blocks are freed then) and is counted as a client abort
(HTTP 499 in the metrics, one log line), never as a server error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.engine.admission import TTFT_MARGIN
from ember.engine.embedding import EmbeddingError
from ember.engine.intake import SLO
from ember.engine.output import RequestOutput
from ember.errors import EmberError
from ember.server import anthropic, backend, embeddings, ollama, openapi, tools
from ember.server import protocol as P
from ember.server import render as R
from ember.server.adapters import ServedAdapters
from ember.server.auth import Keys
from ember.server.backend import Backend, EngineView, PreparedGroup
from ember.server.chat_page import mount_chat_page
from ember.server.config import ServerConfig
from ember.server.errors import (
    APIError,
    as_api_errors,
    overloaded,
    slo_unattainable,
    unsupported,
)
from ember.server.generation import Admitted, Streams
from ember.server.metrics import Metrics
from ember.server.routes import CHAT, COMPLETIONS, GENERATION_ROUTES, RESPONSES, Route
from ember.server.telemetry import RequestRecord, Telemetry
from ember.server.transport import (
    ClientGone,
    JSONBody,
    decode_json,
    disconnected,
    drain_request,
    read_body,
    replay_body,
)

log = logging.getLogger("ember.server")


@dataclass(frozen=True)
class Prepared:
    """What preparation made of a request; its parsed body stays as the client sent it."""

    req: Any  # the protocol body
    groups: list[PreparedGroup]  # one per prompt: its n choices
    names: dict[str, str]  # engine parameter names -> the names the request used
    shape: R.Shape = R.Shape()  # how its replies are read
    adapter: str | None = None  # the LoRA adapter it runs with


class Server:
    """The engine (loaded in the background) plus everything routes share."""

    def __init__(self, config: ServerConfig,
                 start: Callable[[], Backend] | None = None) -> None:
        self.config = config
        # the engine thread, or what ``start`` builds instead (``ember serve --replicas``:
        # a set of replicas on Ray Serve behind the same interface)
        self.thread: Backend | None = None
        self.load_error: str | None = None
        self.metrics = Metrics(self._engine_stats, self._extra_metrics,
                               self._metrics_model_name, config.engine.max_loras)
        self.telemetry = Telemetry(config.otlp_traces_endpoint, config.trace_content,
                                   config.request_log)
        self._start = start or (lambda: backend.local(config.engine))
        self.keys = Keys(config)
        self.streams = Streams(self.metrics, self.telemetry)
        self.adapters = ServedAdapters(config, lambda: self.engine, self.model_names)
        self._prep = ThreadPoolExecutor(config.prep_threads, thread_name_prefix="ember-prep")
        self._admin = threading.Lock()  # admin work, one call at a time, off the prep pool

    # ------------------------------------------------------------ lifecycle
    def start_loading(self) -> threading.Thread:
        t = threading.Thread(target=self._load, name="ember-load", daemon=True)
        t.start()
        return t

    def _load(self) -> None:
        try:
            thread = self._start()
            for name, path in self.config.loras.items():
                thread.engine.load_lora(name, path)
                self.adapters.allow(name, None)
            self.thread = thread
            loaded = self.thread.engine.loaded
            log.info("model %s ready in %.2fs", loaded.name, loaded.load_seconds)
            # torch, the model and the tokenizer are a million long-lived objects: left in
            # the collected generations, every full collection walks them all (~100 ms,
            # measured), stalling the event loop mid-burst. They live as long as we do.
            gc.freeze()
        except Exception as e:
            log.exception("loading the model failed")
            self.load_error = str(e)

    def release(self) -> None:
        """Forget the engine (stopped by the caller) and all that was read from it, so
        that its memory can go; :meth:`start_loading` loads it again (a several-model
        server's unload: ember/server/models.py). Adapters loaded at run time go with
        it; ``--lora`` ones load again with the model."""
        self.thread, self.load_error = None, None
        self.adapters = ServedAdapters(self.config, lambda: self.engine, self.model_names)
        for cached in ("tool_style", "_card"):
            self.__dict__.pop(cached, None)

    @property
    def ready(self) -> bool:
        return self.thread is not None and self.thread.alive

    @property
    def engine(self) -> EngineView:
        return self._thread().engine

    def _thread(self) -> Backend:
        if not self.ready:
            raise APIError(503, self.load_error or "the model is still loading",
                             type="server_error", code="model_not_ready")
        assert self.thread is not None
        return self.thread

    @functools.cached_property
    def tool_style(self) -> tools.ToolStyle:
        """How the served model takes tools (its template, probed once)."""
        loaded = self.engine.loaded
        return tools.tool_style(loaded.chat_template, loaded.tokenizer)

    def _metrics_model_name(self) -> str:
        """The name requests use for the model (before it loads: as configured)."""
        if not self.ready:
            return self.config.served_model_name or self.config.engine.model
        return self.model_names()[0]

    def model_names(self) -> list[str]:
        engine = self.engine
        names = [self.config.served_model_name or engine.loaded.name]
        # also the name it was started with (an alias, a path, a Hub name)
        given = (engine.loaded.name, str(engine.loaded.path), self.config.engine.model)
        return names + [n for n in dict.fromkeys(given) if n not in names]

    def abort_all(self) -> None:
        """Abort every in-flight generation (the end of a graceful shutdown)."""
        if self.thread is not None:
            self.thread.abort_all()

    def _engine_stats(self) -> dict[str, Any]:
        return self.thread.engine.metrics() if self.thread else {}

    def _extra_metrics(self) -> list[str]:
        return self.thread.metric_lines() if self.thread else []

    # ------------------------------------------------------------ admission
    async def admit(self, request: Request, route: Route) -> Admitted:
        """Steps 1 and 2 of the module docstring; the result holds its queue places."""
        arrival = time.monotonic()  # what the client's TTFT counts from
        tenant = self.keys.tenant(request)
        record = self._record(request, tenant, arrival)
        raw = await read_body(request, self.config.max_request_bytes, self.config.body_timeout)
        thread = self._thread()
        with as_api_errors({}):
            first = thread.slot(tenant)
        try:
            preparing = self._prep.submit(self._prepare, route, raw, tenant, arrival)
            try:
                prepared = await asyncio.wrap_future(preparing)
            except asyncio.CancelledError:  # what it prepares anyway is never submitted
                preparing.add_done_callback(lambda f: _discard_prepared(f, thread))
                raise
            req, groups = prepared.req, prepared.groups
            slots = [first]
            try:
                with as_api_errors({}):
                    slots += [thread.slot(tenant) for _ in groups[1:]]
            except BaseException:
                for group in groups:
                    thread.discard(group.work)
                for slot in slots[1:]:
                    slot.release()
                raise
        except BaseException:
            first.release()
            raise
        if record is not None:
            record.prepared = time.monotonic()
            record.model, record.adapter = req.model or "", prepared.adapter
            record.params = {"max_tokens": getattr(req, route.cap(req), None),
                             "temperature": getattr(req, "temperature", None),
                             "top_p": getattr(req, "top_p", None),
                             "seed": getattr(req, "seed", None)}
            if self.telemetry.content:
                record.prompt = raw.decode("utf-8", "replace")
        return Admitted(req, groups, slots, prepared.names, thread.discard,
                        prepared.shape, record)

    def _record(self, request: Request, tenant: str, arrival: float) -> RequestRecord | None:
        """The request's trace and log record, when either is on (else nothing)."""
        if not self.telemetry.enabled:
            return None
        carrier = {k: request.headers[k] for k in ("traceparent", "tracestate")
                   if k in request.headers}
        return RequestRecord(request.url.path, tenant, arrival, carrier)

    def _prepare(self, route: Route, raw: bytes, tenant: str, arrival: float) -> Prepared:
        """Runs in a preparation thread: decode, validate, tokenize, engine.prepare."""
        req = P.parse(route.body, decode_json(raw))
        lora = self.adapters.check_model(req.model, tenant)
        with as_api_errors({}):
            slo = self._slo(req)
        groups: list[PreparedGroup] = []
        built = route.build(self, req)
        names = route.names(req, built.shape)
        try:
            for prompt_ids, params in built.prompts:
                with as_api_errors(names):
                    groups.append(PreparedGroup.of(self.engine.prepare(
                        prompt_ids, params, tenant=tenant, priority=req.priority or 0,
                        slo=slo, weight=self.config.tenant_weights.get(tenant, 1.0),
                        arrival=arrival, references=req.references or (), lora=lora)))
        except BaseException:
            for group in groups:  # a later prompt failed: the earlier ones never run
                self._thread().discard(group.work)
            raise
        return Prepared(req, groups, names, built.shape, lora)

    def _slo(self, req: Any) -> SLO | None:
        """The request's objectives: its own ``slo`` extension, else the server's."""
        own = req.slo or P.SLOSpec()
        ttft = own.ttft_ms / 1000 if own.ttft_ms is not None else self.config.slo_ttft
        tpot = own.tpot_ms / 1000 if own.tpot_ms is not None else self.config.slo_tpot
        return SLO(ttft, tpot) if ttft is not None or tpot is not None else None

    # ------------------------------------------------------------ admin work
    async def run_admin(self, work: Callable[..., Any], *args: Any) -> Any:
        """Admin work (reading, hashing and packing an adapter; purging a cache) on a
        thread of its own, one call at a time, never on the pool that generation requests
        need: a slow or hostile load cannot starve them. Past ``admin_timeout`` the caller
        gets a 504 (the work runs on; the next admin call waits for it). The thread is a
        daemon: it never keeps the process from ending on SIGTERM."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():
                return
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

        def run() -> None:
            with self._admin:
                try:
                    outcome: tuple[Any, BaseException | None] = (work(*args), None)
                except BaseException as e:  # handed to the caller's coroutine
                    outcome = (None, e)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(settle, *outcome)

        threading.Thread(target=run, name="ember-admin", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.config.admin_timeout)
        except TimeoutError:
            raise APIError(504, f"the admin call took more than {self.config.admin_timeout:g}"
                           " s; it goes on in the background", code="admin_timeout") from None

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt that cannot fit the context window: no
        token is longer than the vocabulary's longest, so ``chars / longest`` tokens is
        a lower bound."""
        longest = self.engine.tokenizer.max_token_bytes
        at_least = -(-chars // longest)
        limit = self.engine.max_model_len
        if at_least > limit:
            raise APIError(400, f"'{param}' is at least {at_least} tokens long ({chars} "
                             f"characters); the context window is {limit} tokens",
                             param=param, code="context_length_exceeded")

    def chat_ids(self, messages: list[dict[str, Any]], param: str,
                 variables: dict[str, Any] | None = None) -> list[int]:
        self.check_prompt_chars(sum(len(m["content"] or "") for m in messages), param)
        try:
            return self.engine.loaded.encode_chat(messages, **(variables or {}))
        except EmberError as e:
            where = getattr(e, "param", None)
            if where and where.startswith("messages"):
                where = param + where[len("messages"):]
            raise APIError(400, f"cannot apply the chat template: {e}",
                             param=where or param) from None

    # ------------------------------------------------------------ embeddings
    async def embed(self, request: Request, body: type[Any]
                    ) -> tuple[Any, list[torch.Tensor], int]:
        """An embeddings body (OpenAI's or Ollama's) or a rerank body, its vectors (or
        scores) and token count: the inputs tokenized in a preparation thread, run on
        the engine thread beside generation, holding a queue place (the same limits as
        generation) meanwhile."""
        tenant = self.keys.tenant(request)
        raw = await read_body(request, self.config.max_request_bytes, self.config.body_timeout)
        thread = self._thread()
        with as_api_errors({}), thread.slot(tenant):
            req = await asyncio.wrap_future(self._prep.submit(
                self._embedding_ids, body, raw, tenant))
            try:
                vectors = await self._embedded(request, thread, req)
            except EmbeddingError as e:
                raise APIError(400, str(e), param=e.param or "model") from None
        dimensions = getattr(req.body, "dimensions", None)
        vectors = [embeddings.shortened(v, dimensions) for v in vectors]
        return req.body, vectors, sum(map(len, req.ids))

    async def _embedded(self, request: Request, thread: Backend,
                        req: embeddings.Prepared) -> list[torch.Tensor]:
        """The engine's answer, or, when the client leaves first, the request dropped
        before its next pass (and ClientGone)."""
        future = thread.embed(req.ids, req.body.scores)
        answer, gone = asyncio.wrap_future(future), disconnected(request)
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                thread.cancel_embed(future)
                answer.cancel()  # nobody will read what the engine settles it with
                raise ClientGone()
            return answer.result()
        finally:
            gone.cancel()

    def _embedding_ids(self, body: type[Any], raw: bytes, tenant: str
                       ) -> embeddings.Prepared:
        req = P.parse(body, decode_json(raw))
        if self.adapters.check_model(req.model, tenant) is not None:
            raise unsupported("model", f"names the LoRA adapter '{req.model}'; embeddings "
                              "and scores come from the base model")
        embeddings.check_dimensions(getattr(req, "dimensions", None),
                                    self.engine.loaded.model.cfg.hidden_size)
        return embeddings.Prepared(req, req.input_ids(self.engine))

    # ------------------------------------------------------------ tokenizer routes
    @property
    def prep_pool(self) -> ThreadPoolExecutor:
        """The threads that decode, template and tokenize requests off the event loop."""
        return self._prep

    def tokenize(self, req: P.TokenizeRequest) -> dict[str, Any]:
        """Runs in a preparation thread (a long prompt takes a while to tokenize)."""
        loaded, tokenizer = self.engine.loaded, self.engine.tokenizer
        if req.messages is not None:
            messages = req.template_messages()
            self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
            try:
                ids = loaded.encode_chat(messages, req.add_generation_prompt)
            except EmberError as e:
                raise APIError(400, f"cannot apply the chat template: {e}",
                                 param="messages") from None
        else:
            assert req.prompt is not None
            self.check_prompt_chars(len(req.prompt), "prompt")
            add_bos = tokenizer.add_bos if req.add_special_tokens in (None, True) else False
            ids = tokenizer.encode(req.prompt, add_bos=add_bos)
        strs = ([tokenizer.token_bytes(t).decode("utf-8", "replace") for t in ids]
                if req.return_token_strs else None)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, req: P.DetokenizeRequest) -> dict[str, Any]:
        vocab = self.engine.tokenizer.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"'tokens[{i}]' = {t} is not a token id (0..{vocab - 1})",
                                 param=f"tokens[{i}]")
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    def count_message_tokens(self, req: anthropic.CountTokensRequest) -> list[int]:
        """The prompt a Messages body renders to (in a preparation thread)."""
        return anthropic.prompt_ids(self, req, req.tool_plan(self.tool_style))

    @functools.cached_property
    def _card(self) -> ollama.ModelCard:
        return ollama.ModelCard.of(self.engine.loaded, self.model_names()[0],
                                   self.engine.max_model_len)

    def model_card(self) -> ollama.ModelCard:
        """The served model as Ollama's model routes describe it (503 while it loads)."""
        self.model_names()
        return self._card

    def chat_template_source(self) -> str | None:
        template = self.engine.loaded.chat_template
        return None if template is None else template.source

    def capabilities(self) -> list[str]:
        """Ollama's capability names for the served model: tools work on any model with
        a chat template (described to it where its template does not take them)."""
        caps = ["completion"]
        if self.engine.loaded.chat_template is not None:
            caps.append("tools")
        if self.engine.thinking_tags is not None:
            caps.append("thinking")
        return caps

    def tokenizer_info(self) -> dict[str, Any]:
        loaded, tok = self.engine.loaded, self.engine.tokenizer

        def text(token: int | None) -> str | None:
            return None if token is None else tok.token_bytes(token).decode("utf-8", "replace")

        return {"tokenizer_class": type(tok).__name__, "model": self.model_names()[0],
                "vocab_size": tok.vocab_size, "model_max_length": self.engine.max_model_len,
                "bos_token": text(tok.bos_id), "bos_token_id": tok.bos_id,
                "eos_token": text(tok.eos_id), "eos_token_id": tok.eos_id,
                "add_bos_token": bool(tok.add_bos),
                "chat_template": loaded.chat_template.source if loaded.chat_template else None}

    # ------------------------------------------------------------ generation
    def generate(self, adm: Admitted, request: Request
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Hand the admitted groups to the engine now; see :meth:`Streams.start`."""
        return self.streams.start(adm, self._thread(), lambda: disconnected(request))


def _discard_prepared(done: Any, thread: Any) -> None:
    if not done.cancelled() and done.exception() is None:
        for group in done.result().groups:
            thread.discard(group.work)


class AdmissionGate:
    """ASGI middleware: answer a generation request 429 at once, before routing, while
    the queue is full, or while the queue already ahead of it takes it past the server's
    TTFT objective.

    In a burst, the cost of each refusal is what the last request in line waits for,
    and under overload every refusal's CPU is taken from the engine beside it: refusing
    here, before JSON decoding, the chat template, tokenizing and the engine thread,
    makes it a few microseconds. The TTFT check reads the engine's last quote
    (:class:`~ember.engine.forecast.Quote`) for the key's tenant, counting nothing of
    the request's own prompt (the preparing thread adds it). A request naming its own
    ``priority`` or ``slo`` (which the gate does not parse) and a body over
    GATE_BODY_BYTES pass through to the later checks. An unauthenticated request passes
    through (the route answers 401).
    """

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        thread = self.server.thread
        if (scope["type"] != "http" or scope["path"] not in GENERATION_ROUTES
                or scope["method"] != "POST" or thread is None):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        tenant = self.server.keys.tenant_of(headers)
        if tenant is None:
            await self.app(scope, receive, send)
            return
        if thread.queue_full():
            e = overloaded(f"queue is full ({self.server.config.engine.max_queue} requests)")
            await drain_request(scope, receive)
            await self._refuse(scope, receive, send, e)
            return
        objective, quote = self.server.config.slo_ttft, thread.quoted()[0]
        size = headers.get(b"content-length", b"")
        if (objective is None or quote is None or not size.isdigit()
                or int(size) > GATE_BODY_BYTES):
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(Request(scope, receive), GATE_BODY_BYTES,
                                  self.server.config.body_timeout)
        except APIError as e:  # 415 or 408, as the route would answer
            await self._refuse(scope, receive, send, e)
            return
        except ClientGone:
            return
        receive = replay_body(raw, receive)
        if b'"priority"' not in raw and b'"slo"' not in raw:
            quote, on_the_way = thread.quoted()  # as of now, not before the body came
            late = (quote.ttft(tenant, on_the_way=on_the_way, now=time.monotonic())
                    - TTFT_MARGIN * objective)
            if late > 0:
                await self._refuse(scope, receive, send, slo_unattainable(
                    "the queue ahead already takes a request past the time-to-first-"
                    f"token objective ({objective:g} s)", late))
                return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any,
                      e: APIError) -> None:
        self.server.metrics.count_http(scope["path"], e.status)
        body = JSONBody(error_body(scope["path"], e), status_code=e.status,
                        headers={**e.headers, "Connection": "close"})
        await body(scope, receive, send)


GATE_BODY_BYTES = 256 * 1024  # bodies the gate reads to check them (larger: the route's)


# ====================================================================== the app
def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="ember", version="0.1.0", default_response_class=JSONBody,
                  description="OpenAI-compatible server for GGUF models")
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        server.metrics.count_http(request.url.path, e.status)
        return JSONBody(error_body(request.url.path, e), status_code=e.status,
                        headers=e.headers)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, e: ClientGone) -> Response:
        server.metrics.count_client_abort(request.url.path)
        log.info("client disconnected: %s %s (request aborted)", request.method,
                 request.url.path)
        return Response(status_code=499)  # nobody reads it; uvicorn drops it

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        return await _api_error(request, APIError(400, f"invalid request: {e.errors()[0]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        return await _api_error(request, APIError(e.status_code, str(e.detail),
                                                    headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return await _api_error(request, APIError(500, f"internal error: {type(e).__name__}",
                                                    type="server_error"))

    @app.get("/health", responses=openapi.HEALTH)
    async def health() -> Response:
        if server.ready:
            return JSONBody({"status": "ok"})
        status = "error" if server.load_error else "loading"
        return JSONBody({"status": status, "error": server.load_error}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS)
    async def metrics(request: Request) -> Response:
        server.keys.check_metrics_access(request)
        # off the event loop: with replicas, rendering may wait for their fresh stats
        text = await asyncio.get_running_loop().run_in_executor(None, server.metrics.render)
        return PlainTextResponse(text,
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=openapi.MODELS)
    async def models(request: Request) -> Response:
        tenant = server.keys.tenant(request)
        created = int(time.time())
        base = server.model_names()[0]
        data = [{"id": base, "object": "model", "created": created, "owned_by": "ember",
                 "parent": None}]
        data += [{"id": n, "object": "model", "created": created, "owned_by": "ember",
                  "parent": base} for n in server.adapters.for_tenant(tenant)]
        if "anthropic-version" in request.headers:  # Anthropic's SDK lists models here too
            return _ok(request, server, anthropic.model_list(
                [d["id"] for d in data], created, server.engine.max_model_len))
        return _ok(request, server, {"object": "list", "data": data})

    @app.post("/v1/load_lora_adapter", responses=openapi.LORA_ADMIN)
    async def load_lora_adapter(request: Request) -> Response:
        server.keys.check_admin(request)
        server.model_names()  # 503 while the model loads
        body = _object(decode_json(await read_body(
            request, server.config.max_request_bytes, server.config.body_timeout)))
        return _ok(request, server, await server.run_admin(server.adapters.load, body))

    @app.post("/v1/unload_lora_adapter", responses=openapi.LORA_ADMIN)
    async def unload_lora_adapter(request: Request) -> Response:
        server.keys.check_admin(request)
        server.model_names()
        body = _object(decode_json(await read_body(
            request, server.config.max_request_bytes, server.config.body_timeout)))
        return _ok(request, server, server.adapters.unload(body))

    @app.delete("/v1/cache", responses=openapi.CACHE_ADMIN)
    async def purge_cache(request: Request, tenant: str | None = None) -> Response:
        """Forget a tenant's cached prefixes, in RAM and on the disk tier (admin key)."""
        server.keys.check_admin(request, "purging cached prefixes")
        thread = server._thread()
        if not tenant:
            raise APIError(400, "name the tenant whose cache to purge: "
                           "DELETE /v1/cache?tenant=NAME", param="tenant")
        with as_api_errors({}):
            removed = await server.run_admin(thread.purge_cache, tenant)
        log.info("purged the cached prefixes of tenant %r: %s", tenant, removed)
        return _ok(request, server, {"tenant": tenant, **removed})

    @app.post("/v1/chat/completions", **openapi.route(P.ChatCompletionRequest,
                                                      openapi.ChatCompletion))
    async def chat(request: Request) -> Response:
        adm = await server.admit(request, CHAT)
        req, tokenizer, ids = adm.req, server.engine.tokenizer, R.Ids("chatcmpl")
        stream = server.generate(adm, request)
        if req.stream:
            return await _sse(request, server, R.chat_chunks(stream, req, ids, tokenizer,
                                                             adm.shape))
        outs = await _collect(stream, req.n)
        return _ok(request, server, R.chat_body(outs, req, ids, tokenizer, adm.shape))

    @app.post("/v1/completions", **openapi.route(P.CompletionRequest, openapi.Completion))
    async def completions(request: Request) -> Response:
        adm = await server.admit(request, COMPLETIONS)
        req, tokenizer, ids = adm.req, server.engine.tokenizer, R.Ids("cmpl")
        stream = server.generate(adm, request)
        if req.stream:
            return await _sse(request, server, R.completion_chunks(stream, req, ids, tokenizer))
        outs = await _collect(stream, req.n * len(adm.groups))
        per_prompt = [outs[p * req.n:(p + 1) * req.n] for p in range(len(adm.groups))]
        echoed = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompts()] \
            if req.echo else None
        return _ok(request, server, R.completion_body(per_prompt, req, ids, tokenizer,
                                                      echoed))

    @app.post("/v1/responses", **openapi.route(P.ResponsesRequest, openapi.ResponseObject))
    async def responses(request: Request) -> Response:
        adm = await server.admit(request, RESPONSES)
        req, ids = adm.req, R.Ids("resp")
        stream = server.generate(adm, request)
        if req.stream:
            return await _sse(request, server, R.response_events(stream, req, ids,
                                                                 adm.shape))
        out = (await _collect(stream, 1))[0]
        return _ok(request, server, R.response_body(req, ids, out, "completed",
                                                    shape=adm.shape))

    @app.post("/v1/messages", **openapi.route(anthropic.MessagesRequest, openapi.Message))
    async def messages(request: Request) -> Response:
        adm = await server.admit(request, anthropic.MESSAGES)
        req, msg_id = adm.req, anthropic.message_id()
        stream = server.generate(adm, request)
        if req.stream:
            return await _sse(request, server, anthropic.message_events(
                stream, req, adm.shape, msg_id), anthropic.error_event)
        out = (await _collect(stream, 1))[0]
        return _ok(request, server, anthropic.message_body(req, out, adm.shape, msg_id))

    @app.post("/v1/messages/count_tokens",
              **openapi.route(anthropic.CountTokensRequest, openapi.TokenCount))
    async def count_tokens(request: Request) -> Response:
        body = await _tokenizer_body(request, server, anthropic.CountTokensRequest)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(server.prep_pool, server.count_message_tokens, body)
        return _ok(request, server, {"input_tokens": len(ids)})

    @app.post("/api/chat", **openapi.route(ollama.ChatRequest, openapi.OllamaReply))
    async def ollama_chat(request: Request) -> Response:
        return await _ollama(request, server, ollama.CHAT, chat=True)

    @app.post("/api/generate", **openapi.route(ollama.GenerateRequest, openapi.OllamaReply))
    async def ollama_generate(request: Request) -> Response:
        return await _ollama(request, server, ollama.GENERATE, chat=False)

    @app.get("/api/tags", responses=openapi.OLLAMA_MODELS)
    async def ollama_tags(request: Request) -> Response:
        server.keys.tenant(request)
        return _ok(request, server, {"models": [server.model_card().entry()]})

    @app.get("/api/ps", responses=openapi.OLLAMA_MODELS)
    async def ollama_ps(request: Request) -> Response:
        server.keys.tenant(request)
        return _ok(request, server, {"models": [server.model_card().running()]})

    @app.post("/api/show", **openapi.route(ollama.ShowRequest, openapi.OllamaShow, False))
    async def ollama_show(request: Request) -> Response:
        tenant = server.keys.tenant(request)
        body = P.parse(ollama.ShowRequest, decode_json(await read_body(
            request, server.config.max_request_bytes, server.config.body_timeout)))
        server.adapters.check_model(body.named, tenant)
        return _ok(request, server, server.model_card().show(
            server.chat_template_source(), server.capabilities()))

    @app.get("/api/version", responses=openapi.OLLAMA_VERSION)
    async def ollama_version(request: Request) -> Response:
        return _ok(request, server, {"version": ollama.API_VERSION})

    @app.post("/v1/embeddings",
              **openapi.route(embeddings.EmbeddingsRequest, openapi.EmbeddingList, False))
    async def embed(request: Request) -> Response:
        req, vectors, tokens = await server.embed(request, embeddings.EmbeddingsRequest)
        return _ok(request, server, embeddings.openai_body(req, vectors, tokens))

    @app.post("/api/embed",
              **openapi.route(embeddings.OllamaEmbedRequest, openapi.OllamaEmbeddings, False))
    async def ollama_embed(request: Request) -> Response:
        start = time.monotonic_ns()
        req, vectors, tokens = await server.embed(request, embeddings.OllamaEmbedRequest)
        return _ok(request, server, embeddings.ollama_body(
            req, vectors, tokens, time.monotonic_ns() - start))

    @app.post("/v1/rerank", **openapi.route(embeddings.RerankRequest, openapi.Reranked, False))
    @app.post("/rerank", include_in_schema=False)
    async def rerank(request: Request) -> Response:
        req, scores, tokens = await server.embed(request, embeddings.RerankRequest)
        return _ok(request, server, embeddings.rerank_body(req, scores, tokens))

    @app.post("/tokenize", **openapi.route(P.TokenizeRequest, openapi.Tokenized, False))
    async def tokenize(request: Request) -> Response:
        body = await _tokenizer_body(request, server, P.TokenizeRequest)
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(server.prep_pool, server.tokenize, body)
        return _ok(request, server, out)

    @app.post("/detokenize", **openapi.route(P.DetokenizeRequest, openapi.Detokenized, False))
    async def detokenize(request: Request) -> Response:
        body = await _tokenizer_body(request, server, P.DetokenizeRequest)
        return _ok(request, server, server.detokenize(body))

    @app.get("/tokenizer_info", responses=openapi.TOKENIZER_INFO)
    async def tokenizer_info(request: Request) -> Response:
        server.keys.tenant(request)
        return _ok(request, server, server.tokenizer_info())

    openapi.install(app)
    if server.config.chat_page:
        mount_chat_page(app, server.keys.may_see_page)
    return app


async def _tokenizer_body(request: Request, server: Server, model: type) -> Any:
    tenant = server.keys.tenant(request)
    server.model_names()  # 503 while the model loads
    raw = await read_body(request, server.config.max_request_bytes, server.config.body_timeout)
    body = P.parse(model, decode_json(raw))
    server.adapters.check_model(body.model, tenant)  # an adapter shares the base's tokenizer
    return body


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    return value


# ---------------------------------------------------------------------- helpers
def _ok(request: Request, server: Server, body: dict[str, Any]) -> Response:
    server.metrics.count_http(request.url.path, 200)
    return JSONBody(body)


async def _collect(stream: AsyncIterator[tuple[int, RequestOutput]], n: int
                   ) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for i, out in stream:
        if out.finished:
            final[i] = out
    return [final[i] for i in range(n)]


async def _sse(request: Request, server: Server, events: AsyncIterator[str],
               error_event: Callable[[APIError], str] = lambda e: R.sse_data(e.body()),
               media_type: str = "text/event-stream") -> Response:
    """Start streaming only once the first event exists, so that errors raised before
    any token (a bad request, a grammar failing on the first token) are answered as
    plain JSON with their status. A failure after that is the stream's last event
    (``error_event``)."""
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
            server.metrics.count_client_abort(request.url.path)
            log.info("client disconnected mid-stream: %s %s (request aborted)",
                     request.method, request.url.path)
        except APIError as e:  # mid-stream failure: say so in-band, then end
            yield error_event(e)
        finally:
            await events.aclose()

    server.metrics.count_http(request.url.path, 200)
    return StreamingResponse(body(), media_type=media_type,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _ollama(request: Request, server: Server, route: Route, chat: bool) -> Response:
    clock = ollama.Clock()
    try:
        adm = await server.admit(request, route)
    except ollama.ModelLoaded as e:  # nothing to generate: the model is loaded (always)
        return _ok(request, server, ollama.Reply(e.req, chat).loaded())
    reply = ollama.Reply(adm.req, chat)
    stream = server.generate(adm, request)
    if adm.req.stream:
        return await _sse(request, server, reply.lines(stream, adm.shape, clock),
                          ollama.error_line, "application/x-ndjson")
    final = None
    async for _, out in stream:
        clock.saw(out)  # the first token's time: where prompt_eval ends and eval starts
        final = out if out.finished else final
    assert final is not None
    return _ok(request, server, reply.whole(final, adm.shape, clock))


def error_body(path: str, e: APIError) -> dict[str, Any]:
    """An error in the shape of the API ``path`` belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic.error_body(e)
    if path.startswith("/api/"):
        return ollama.error_body(e)
    return e.body()

