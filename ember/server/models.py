"""Many models behind one port (``ember serve --model A --model B``, ``--models-dir``).

Each model is served by a whole single-model server: its own :class:`Server` and app
(engine thread, queue and tenant quotas, LoRA adapters, prefix cache, metrics), so
nothing a request meets differs from ``ember serve`` with one model. The
:class:`ModelRouter` in front reads which model a request names (the JSON body's
``model``, or ``?model=`` on routes without a body; none: the first model), loads it on
first use (the request waits, its TTFT counting the load), hands the request to that
model's app with its body replayed, and unloads a model that has been idle for
``--models-idle`` seconds or whose memory another model needs under
``--models-max-bytes`` (least recently used first, never one with requests in flight).

The router answers the routes about every model itself: ``/v1/models`` (each with its
state: available, loading, loaded, failed), Ollama's ``/api/tags`` and ``/api/ps``,
``/health``, ``/metrics`` (each model's metrics labelled ``model``), and the admin
routes ``POST /models/load`` and ``/models/unload`` (behind ``--admin-api-key``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request

from ember.models.gguf import SPLIT_NAME
from ember.models.registry import MODELS, resolve_model
from ember.prometheus import family
from ember.server import anthropic
from ember.server.app import AdmissionGate, Server, create_app, error_body
from ember.server.auth import Keys
from ember.server.config import ServerConfig
from ember.server.errors import APIError, as_api_errors
from ember.server.transport import (
    ClientGone,
    JSONBody,
    decode_json,
    read_body,
    replay_body,
)

log = logging.getLogger("ember.server")
# routes that need no model: the default model's app answers them, loading nothing
STATIC = ("/", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/api/version",
          "/favicon.ico")
OLLAMA_GENERATION = ("/api/generate", "/api/chat")  # where keep_alive 0 unloads
IDLE_CHECK_SECONDS = 1.0  # how often idle models are looked for
LOAD_POLL_SECONDS = 0.02  # how often a request waiting for a load looks again


def model_sources(models: list[str], models_dir: Path | None) -> list[str]:
    """What ``--model`` (repeated) and ``--models-dir`` name, in that order: every
    ``.gguf`` in the directory (a split model by its first part), sorted by name."""
    sources = list(models)
    if models_dir is not None:
        if not models_dir.is_dir():
            raise ValueError(f"--models-dir: {models_dir} is not a directory")
        for path in sorted(models_dir.glob("*.gguf")):
            split = SPLIT_NAME.match(path.name)
            if split is None or int(split["no"]) == 1:
                sources.append(str(path))
    if not sources:
        raise ValueError(f"--models-dir: no .gguf file in {models_dir}")
    return sources


def model_name(source: str) -> str:
    """The id a model is listed and requested by: a registered file's alias, a file's
    stem (a split model's prefix), else the alias or Hub name as given."""
    path = Path(source)
    alias = next((m.alias for m in MODELS.values() if m.filename == path.name), None)
    if alias is not None:
        return alias
    if source.endswith(".gguf"):
        split = SPLIT_NAME.match(path.name)
        return split["prefix"] if split else path.stem
    return source


class OllamaUnload(Exception):
    """A request that is Ollama's unload (answered by the router, loading nothing)."""

    def __init__(self, entry: ServedModel) -> None:
        super().__init__(entry.name)
        self.entry = entry


@dataclass
class ServedModel:
    """One model of the router: where it comes from, and its server. The server and its
    app are made once, at first use, and kept (the app's routes hold the server);
    loading starts its engine, unloading stops it and drops everything it read."""

    name: str
    source: str
    server: Server | None = None
    app: Any = None
    active: bool = False  # loading or loaded
    unloading: bool = False  # its engine is stopping (its memory not yet given back)
    running: int = 0  # requests in the router for it (waiting for the load included)
    last_used: float = 0.0
    error: str | None = None  # why the last load failed

    @property
    def loaded(self) -> bool:
        return self.active and self.server is not None and self.server.ready

    @property
    def state(self) -> str:
        if self.unloading:
            return "unloading"
        if not self.active or self.server is None:
            return "failed" if self.error else "available"
        if self.server.ready:
            return "loaded"
        return "failed" if _failure(self.server) else "loading"

    def names(self) -> set[str]:
        names = {self.name, self.source}
        if self.loaded:
            assert self.server is not None
            names.update(self.server.model_names())
        return names

    def file_bytes(self) -> int:
        """The model's file(s) on disk (0 where not pulled yet)."""
        try:
            first = resolve_model(self.source)
        except Exception:  # not pulled yet, or missing: the load will say so
            return 0
        split = SPLIT_NAME.match(first.name)
        if split is None:
            return first.stat().st_size
        return sum(p.stat().st_size for p in first.parent.glob(
            f"{split['prefix']}-*-of-{split['count']}.gguf"))


class ModelRouter:
    """The ASGI app of a many-model server (module docstring)."""

    def __init__(self, config: ServerConfig, graceful_seconds: float = 10.0) -> None:
        self.config, self.graceful_seconds = config, graceful_seconds
        self.keys = Keys(config)
        self.models: list[ServedModel] = []
        for source in config.models:
            entry = ServedModel(model_name(source), source)
            if any(entry.name in m.names() for m in self.models):
                raise ValueError(f"two models are named {entry.name!r}; rename a file")
            self.models.append(entry)
        self._lock = asyncio.Lock()  # one load or unload decision at a time
        self._idle_task: asyncio.Task | None = None
        self.slow_closes = 0
        self.http: Counter[tuple[str, int]] = Counter()  # the router's own answers
        self._routes: set[str] | None = None
        get, post = ("GET",), ("POST",)
        self._own: dict[str, tuple[tuple[str, ...], Callable[[Request], Awaitable[Any]]]] = {
            "/v1/models": (get, self._list), "/models": (get, self._list),
            "/api/tags": (get, self._tags), "/api/ps": (get, self._ps),
            "/health": (get, self._health), "/metrics": (get, self._metrics),
            "/models/load": (post, self._load_route),
            "/models/unload": (post, self._unload_route),
            "/v1/cache": (("DELETE",), self._purge)}

    # ------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        path = scope["path"]
        if path in STATIC or path.startswith("/ui/"):  # no model needed: the default's app
            await self._app_of(self.models[0])(scope, receive, send)
            return
        try:
            if path in self._own:
                methods, handler = self._own[path]
                if scope["method"] not in methods:
                    raise APIError(405, f"{path} takes {' or '.join(methods)}")
                answer = await handler(request)
                await (JSONBody(answer) if isinstance(answer, dict) else answer)(
                    scope, receive, send)
                self.http[(path, 200)] += 1
                return
            tenant = self._may_load(request)  # no load for a request without a key
            entry, receive = await self._pick(request, receive, tenant)
        except APIError as e:
            await self._error(scope, receive, send, e)
            return
        except ClientGone:  # left while sending its body: nothing to answer
            return
        except OllamaUnload as e:
            await JSONBody(await self._ollama_unload(e.entry, path))(scope, receive, send)
            return
        entry.running += 1
        try:
            try:
                await self._ensure_loaded(entry)
            except APIError as e:
                await self._error(scope, receive, send, e)
                return
            await self._app_of(entry)(scope, receive, send)
        finally:
            entry.running -= 1
            entry.last_used = time.monotonic()

    def _may_load(self, request: Request) -> str:
        """The caller's tenant when its API key (or the admin key) is valid, else the
        401 the model's own route would answer: a request without a key loads nothing."""
        try:
            return self.keys.tenant(request)
        except APIError as e:
            try:
                self.keys.check_admin(request)
            except APIError:
                raise e from None
            return ""

    def _app_of(self, entry: ServedModel) -> Any:
        """``entry``'s server and app, made at first use (not loading the model)."""
        if entry.server is None:
            config = dataclasses.replace(
                self.config, models=(), served_model_name=entry.name,
                engine=dataclasses.replace(self.config.engine, model=entry.source))
            entry.server = Server(config)
            entry.app = AdmissionGate(create_app(entry.server), entry.server)
        return entry.app

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.config.models_idle is not None:
                    self._idle_task = asyncio.create_task(self._unload_idle())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._idle_task is not None:
                    self._idle_task.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _error(self, scope: dict[str, Any], receive: Any, send: Any,
                     e: APIError) -> None:
        self.http[(self._route(scope["path"]), e.status)] += 1
        body = JSONBody(error_body(scope["path"], e), status_code=e.status, headers=e.headers)
        await body(scope, receive, send)

    def _route(self, path: str) -> str:
        """``path`` as a metrics label: a route the router or a model serves, else
        "other" (a client's made-up paths must not each become a series)."""
        if self._routes is None:
            app = self._app_of(self.models[0])
            self._routes = set(self._own) | {getattr(r, "path", "") for r in
                                             app.app.routes}
        return path if path in self._routes else "other"

    # ------------------------------------------------------------ picking a model
    async def _pick(self, request: Request, receive: Any, tenant: str
                    ) -> tuple[ServedModel, Any]:
        """The model a request names (its JSON body's, else ``?model=``), and the
        ``receive`` that replays the body."""
        name, unload = None, False
        if request.method == "POST" and "json" in request.headers.get("content-type", ""):
            raw = await read_body(request, self.config.max_request_bytes,
                                  self.config.body_timeout)
            name, unload = await asyncio.to_thread(_named_model, raw)
            receive = replay_body(raw, receive)
        if name is None:
            name = parse_qs(request.scope.get("query_string", b"").decode()).get(
                "model", [None])[0]
        entry = self.find(name, tenant)
        if unload and request.url.path in OLLAMA_GENERATION:
            raise OllamaUnload(entry)
        return entry, receive

    def find(self, name: str | None, tenant: str = "") -> ServedModel:
        """The model ``name`` names (a LoRA adapter's name: its base's, while loaded);
        None: the first model. Unknown: a 404 listing the models."""
        if name is None:
            return self.models[0]
        name = name.removesuffix(":latest")  # Ollama's default tag names the same
        for entry in self.models:
            if name in entry.names():
                return entry
        for entry in self.models:
            if entry.loaded and name in entry.server.adapters.for_tenant(tenant):  # type: ignore[union-attr]
                return entry
        served = ", ".join(m.name for m in self.models)
        raise APIError(404, f"the model '{name}' does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    # ------------------------------------------------------------ loading
    async def _ensure_loaded(self, entry: ServedModel) -> None:
        """Load ``entry`` unless it is (making room under the memory budget first) and
        wait until it serves; a load that fails, or an engine that stopped, is a 503
        and the next request loads it again."""
        if entry.loaded:
            return
        async with self._lock:
            if not entry.active:
                await self._make_room(entry)
                self._app_of(entry)
                assert entry.server is not None
                entry.active, entry.error = True, None
                entry.server.start_loading()
                entry.last_used = time.monotonic()
                log.info("loading model %s (%s)", entry.name, entry.source)
        server = entry.server
        assert server is not None
        while not server.ready:
            failure = _failure(server)
            if failure is not None:
                async with self._lock:
                    if entry.active and entry.server is server and not server.ready:
                        entry.active, entry.error = False, failure
                        await asyncio.to_thread(self._stop, server)
                raise APIError(503, f"the model '{entry.name}' cannot serve: {failure}",
                               type="server_error", code="model_load_failed")
            if not entry.active:  # unloaded meanwhile (an admin): load it again
                await self._ensure_loaded(entry)
                return
            await asyncio.sleep(LOAD_POLL_SECONDS)

    def budget_bytes(self, entry: ServedModel) -> int:
        """What a loaded model is counted at: its file(s) and its KV pool."""
        engine = self.config.engine
        return entry.file_bytes() + (engine.kv_cache_bytes if engine.num_kv_blocks is None
                                     else 0)

    async def _make_room(self, entry: ServedModel) -> None:
        """Unload least recently used idle models until ``entry`` fits the budget."""
        limit = self.config.models_max_bytes
        if limit is None:
            return
        need = self.budget_bytes(entry)
        if need > limit:
            raise APIError(503, f"the model '{entry.name}' needs about {need} bytes (its "
                           f"file and KV pool), more than --models-max-bytes ({limit})",
                           type="server_error", code="model_too_large")
        while True:
            loaded = [m for m in self.models if m.active and m is not entry]
            if sum(self.budget_bytes(m) for m in loaded) + need <= limit:
                return
            idle = [m for m in loaded if m.running == 0 and m.loaded]
            if not idle:
                raise APIError(503, f"no room to load '{entry.name}' under "
                               f"--models-max-bytes ({limit}): every loaded model is "
                               "serving requests; retry later", type="server_error",
                               code="models_busy", headers={"Retry-After": "5"})
            await self._unload(min(idle, key=lambda m: m.last_used))

    async def _unload(self, entry: ServedModel) -> None:
        """Stop ``entry``'s engine (finishing what it runs) and free its memory."""
        if not entry.active or entry.server is None:
            return
        entry.active, entry.unloading = False, True
        log.info("unloading model %s", entry.name)
        try:
            await asyncio.to_thread(self._stop, entry.server)
        finally:
            entry.unloading = False

    def _stop(self, server: Server) -> None:
        thread = server.thread
        if thread is not None:
            thread.drain(timeout=self.graceful_seconds)
            thread.shutdown(timeout=self.graceful_seconds)
        server.release()
        del thread
        # a loaded model's objects were frozen out of the collector (Server._load): let
        # it find the unloaded one's cycles, then freeze what is left again
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    async def _unload_idle(self) -> None:
        idle = self.config.models_idle
        assert idle is not None
        while True:
            await asyncio.sleep(min(IDLE_CHECK_SECONDS, idle))
            now = time.monotonic()
            try:
                async with self._lock:
                    for entry in self.models:
                        if entry.loaded and entry.running == 0 and \
                                now - entry.last_used >= idle:
                            await self._unload(entry)
            except Exception:  # an unload that failed: say so, keep watching
                log.exception("unloading an idle model failed")

    def abort_all(self) -> None:
        for entry in self.models:
            if entry.server is not None:
                entry.server.abort_all()

    def shutdown(self) -> None:
        """Stop every loaded engine (the end of ``ember serve``)."""
        for entry in self.models:
            server, entry.active = entry.server, False
            if server is not None:
                if server.thread is not None:
                    server.thread.drain(timeout=self.graceful_seconds)
                    server.thread.shutdown(timeout=self.graceful_seconds)
                server.telemetry.close()

    def count_slow_close(self) -> None:
        self.slow_closes += 1

    # ------------------------------------------------------------ the router's routes
    async def _list(self, request: Request) -> dict[str, Any]:
        tenant = self.keys.tenant(request)
        created = int(time.time())
        if "anthropic-version" in request.headers:  # the Anthropic SDK's model list
            context = self.config.engine.max_model_len or max(
                (m.server.engine.max_model_len for m in self.models
                 if m.loaded), default=0)
            return anthropic.model_list([m.name for m in self.models], created, context)
        data = []
        for m in self.models:
            item = {"id": m.name, "object": "model", "created": created, "owned_by": "ember",
                    "parent": None, "status": {"value": m.state}}
            if m.error:
                item["status"]["error"] = m.error
            data.append(item)
            if m.state == "loaded":
                assert m.server is not None
                data += [{"id": n, "object": "model", "created": created,
                          "owned_by": "ember", "parent": m.name, "status": {"value": m.state}}
                         for n in m.server.adapters.for_tenant(tenant)]
        return {"object": "list", "data": data}

    async def _tags(self, request: Request) -> dict[str, Any]:
        self.keys.tenant(request)
        return {"models": [self._card(m) for m in self.models]}

    async def _ps(self, request: Request) -> dict[str, Any]:
        self.keys.tenant(request)
        return {"models": [m.server.model_card().running() for m in self.models
                           if m.loaded]}

    def _card(self, m: ServedModel) -> dict[str, Any]:
        """A model as Ollama's /api/tags lists it (from its file while not loaded)."""
        if m.loaded:
            return m.server.model_card().entry()
        try:
            modified = datetime.fromtimestamp(resolve_model(m.source).stat().st_mtime, UTC)
        except Exception:
            modified = datetime.now(UTC)
        tagged = f"{m.name}:latest"
        return {"name": tagged, "model": tagged, "size": m.file_bytes(), "digest": "",
                "modified_at": modified.isoformat().replace("+00:00", "Z"),
                "details": {"format": "gguf"}}

    async def _health(self, request: Request) -> dict[str, Any]:
        return {"status": "ok", "models": {m.name: m.state for m in self.models}}

    async def _metrics(self, request: Request) -> Any:
        from fastapi.responses import PlainTextResponse

        self.keys.check_metrics_access(request)
        texts = {}
        for m in self.models:
            if m.loaded:
                texts[m.name] = await asyncio.to_thread(m.server.metrics.render)
        lines = family("ember_models_loaded", "gauge", "Models loaded by the router.",
                       [("", sum(m.state == "loaded" for m in self.models))])
        lines += family("ember_router_http_responses_total", "counter",
                        "HTTP responses the router gave itself (its own routes, and "
                        "requests refused before reaching a model), by route and status.",
                        [(f'{{route="{route}",status="{status}"}}', n)
                         for (route, status), n in sorted(self.http.items())])
        lines += family("ember_router_slow_connections_closed_total", "counter",
                        "Connections the router closed for sending too slowly.",
                        [("", self.slow_closes)])
        return PlainTextResponse("\n".join(lines + merge_metrics(texts)) + "\n",
                                 media_type="text/plain; version=0.0.4")

    async def _purge(self, request: Request) -> dict[str, Any]:
        """``DELETE /v1/cache?tenant=NAME``: the tenant's cached prefixes forgotten in
        every loaded model (``&model=``: in that one). A model not loaded holds none
        (its RAM went with it; several models run without a disk tier)."""
        self.keys.check_admin(request, "purging cached prefixes")
        query = parse_qs(request.scope.get("query_string", b"").decode())
        tenant = query.get("tenant", [""])[0]
        if not tenant:
            raise APIError(400, "name the tenant whose cache to purge: "
                           "DELETE /v1/cache?tenant=NAME", param="tenant")
        named = query.get("model", [None])[0]
        entries = [self.find(named)] if named is not None else self.models
        total: dict[str, Any] = {"tenant": tenant, "ram_blocks": 0, "models": {}}
        for entry in entries:
            server = entry.server
            if not entry.loaded or server is None or server.thread is None:
                continue
            with as_api_errors({}):
                removed = await server.run_admin(server.thread.purge_cache, tenant)
            total["models"][entry.name] = removed
            total["ram_blocks"] += removed.get("ram_blocks", 0)
        log.info("purged the cached prefixes of tenant %r: %s", tenant, total["models"])
        return total

    async def _ollama_unload(self, entry: ServedModel, path: str) -> dict[str, Any]:
        """Ollama's ``keep_alive: 0`` with nothing to generate: the model is unloaded
        now unless it serves requests (then it stays, as after any request)."""
        async with self._lock:
            if entry.loaded and entry.running == 0:
                await self._unload(entry)
        reply: dict[str, Any] = {
            "model": entry.name, "done": True, "done_reason": "unload",
            "created_at": datetime.now(UTC).isoformat().replace("+00:00", "Z")}
        if path == "/api/chat":
            reply["message"] = {"role": "assistant", "content": ""}
        else:
            reply["response"] = ""
        return reply

    async def _admin_model(self, request: Request) -> ServedModel:
        self.keys.check_admin(request, "loading and unloading models")
        body = decode_json(await read_body(request, self.config.max_request_bytes,
                                           self.config.body_timeout))
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise APIError(400, "'model' must name a model", param="model")
        return self.find(body["model"])

    async def _load_route(self, request: Request) -> dict[str, Any]:
        entry = await self._admin_model(request)
        entry.running += 1
        try:
            await self._ensure_loaded(entry)
        finally:
            entry.running -= 1
            entry.last_used = time.monotonic()
        return {"model": entry.name, "status": entry.state}

    async def _unload_route(self, request: Request) -> dict[str, Any]:
        entry = await self._admin_model(request)
        async with self._lock:
            if entry.running:
                raise APIError(409, f"the model '{entry.name}' is serving {entry.running} "
                               "request(s); unload it when they end", code="model_busy")
            await self._unload(entry)
        return {"model": entry.name, "status": entry.state}


def _failure(server: Server) -> str | None:
    """Why a model that was being loaded does not serve: its load failed, or its engine
    stopped (None: it is still loading, or serves)."""
    if server.load_error is not None:
        return server.load_error
    thread = server.thread
    if thread is not None and not thread.alive:
        return f"its engine stopped ({getattr(thread, 'error', None) or 'no error given'})"
    return None


def _named_model(raw: bytes) -> tuple[str | None, bool]:
    """The ``model`` a JSON body names (Ollama's /api/show may say ``name``; None where
    it names none or does not parse: the model's own route then answers the 400), and
    whether it is Ollama's unload: ``keep_alive: 0`` with nothing to generate."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None, False
    if not isinstance(body, dict):
        return None, False
    name = body.get("model") or body.get("name")
    unload = body.get("keep_alive") in (0, "0", "0s", "0m") and not body.get(
        "prompt") and not body.get("messages")
    return (name if isinstance(name, str) else None), unload


def merge_metrics(texts: dict[str, str]) -> list[str]:
    """Several models' Prometheus texts as one: each family once (its HELP and TYPE),
    every sample labelled with its model."""
    families: dict[str, list[str]] = {}
    heads: dict[str, list[str]] = {}
    order: list[str] = []
    for model, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                family = parts[2] if len(parts) > 2 else family
                if family not in heads:
                    heads[family], families[family] = [], []
                    order.append(family)
                if line not in heads[family]:
                    heads[family].append(line)
                continue
            if not line.strip():
                continue
            families.setdefault(family, [])
            if family not in order:
                heads.setdefault(family, [])
                order.append(family)
            families[family].append(_labelled(line, model))
    return [line for f in order for line in heads[f] + families[f]]


def _labelled(sample: str, model: str) -> str:
    value = model.replace("\\", "\\\\").replace('"', '\\"')
    name, brace, rest = sample.partition("{")
    if brace:
        return f'{name}{{model="{value}",{rest}'
    name, space, rest = sample.partition(" ")
    return f'{name}{{model="{value}"}} {rest}'
