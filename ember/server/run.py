"""Running ``ember serve``: uvicorn around the app, with ember's graceful shutdown (stop
accepting, let in-flight requests finish, abort the rest so every response still ends
properly, then drain and stop the engine)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ember.server.app import AdmissionGate, Server, create_app
from ember.server.backend import Backend
from ember.server.config import ServerConfig
from ember.server.models import ModelRouter
from ember.server.transport import guarded_protocol

SHUTDOWN_FLUSH_SECONDS = 2.0  # after aborting, time for the aborted responses to flush


class Serving:
    """``ember serve``'s HTTP server around a :class:`Server`, its port bound when built
    (port 0: one the system picks, in :attr:`url`). :meth:`run` starts the backend
    loading in the background and serves until SIGINT/SIGTERM (in the main thread) or
    :meth:`stop` (from any thread); then it stops accepting, lets in-flight requests
    finish for up to ``graceful_seconds``, aborts the rest (their responses still end
    properly: a stream gets its finish chunk and ``[DONE]``) and returns 0. ``start``
    builds the backend (default: the local engine thread)."""

    def __init__(self, config: ServerConfig, host: str, port: int,
                 graceful_seconds: float = 10.0,
                 start: Callable[[], Backend] | None = None) -> None:
        import uvicorn

        self.graceful_seconds = graceful_seconds
        # one model: its server; several: a router over one server per model
        self.server: Server | None = None
        self.router: ModelRouter | None = None
        if config.models:
            self.router = ModelRouter(config, graceful_seconds)
            app: Any = self.router
            slow_close, abort_all = self.router.count_slow_close, self.router.abort_all
        else:
            self.server = Server(config, start)
            app = AdmissionGate(create_app(self.server), self.server)
            slow_close, abort_all = self.server.metrics.count_slow_close, self.server.abort_all
        self.app = app
        # uvicorn cancels whatever is still running after its own timeout; ember aborts
        # the generations first, at ``graceful_seconds``, and leaves uvicorn time to
        # flush them.
        uv_config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   http=guarded_protocol(config.header_timeout, slow_close),
                                   timeout_graceful_shutdown=graceful_seconds
                                   + SHUTDOWN_FLUSH_SECONDS)
        self._uv = _uvicorn_server(uvicorn.Server, uv_config, graceful_seconds, abort_all)
        # The port is taken before the backend starts: Ray's processes bind ports of
        # their own while it starts, and one of them could otherwise take this one first.
        self._sock = uv_config.bind_socket()
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"

    def run(self) -> int:
        server = self.server
        if server is not None:
            server.start_loading()
            print(f"ember: listening on {self.url}/v1 (model loading; GET /health)",
                  flush=True)
        else:
            assert self.router is not None
            names = ", ".join(m.name for m in self.router.models)
            print(f"ember: listening on {self.url}/v1 (models, loaded on first use: {names})",
                  flush=True)
        self._uv.run(sockets=[self._sock])
        if server is not None:
            if server.thread is not None:
                server.thread.drain(timeout=self.graceful_seconds)
                server.thread.shutdown(timeout=self.graceful_seconds)
            server.telemetry.close()
        else:
            assert self.router is not None
            self.router.shutdown()
        print("ember: stopped", flush=True)
        return 0

    def stop(self) -> None:
        """End :meth:`run` as SIGTERM does (the graceful shutdown included)."""
        self._uv.should_exit = True


def run_server(config: ServerConfig, host: str, port: int, graceful_seconds: float = 10.0,
               start: Callable[[], Backend] | None = None) -> int:
    """Serve until SIGINT/SIGTERM, logging to stderr (see :class:`Serving`)."""
    _log_to_stderr()
    return Serving(config, host, port, graceful_seconds, start).run()


def _log_to_stderr() -> None:
    """ember's own log lines (model loaded, client disconnects, failed requests) at INFO."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ember_log = logging.getLogger("ember")
    ember_log.addHandler(handler)
    ember_log.setLevel(logging.INFO)


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
