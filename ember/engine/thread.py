"""EngineThread: one thread owns the engine; callers talk to it through queues.

Callers (the HTTP server's event loop, or any thread) submit requests and receive
each request's outputs through a callback or a thread-safe queue. Submissions are
executed on the engine thread, between steps, so the model, the KV pool and the
sampler states are only ever touched by that thread. ``submit`` returns once the
engine accepted the request, and re-raises ``QueueFull`` / ``InvalidRequest`` in
the caller's thread so it can answer 429 / 400 at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from ember.engine.engine import LLMEngine, RequestOutput
from ember.errors import EmberError
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import LogitProcessor

log = logging.getLogger("ember.engine")

OutputCallback = Callable[[RequestOutput], None]


class EngineStopped(EmberError):
    """The engine thread is not running (shut down or crashed)."""


@dataclass
class _Submit:
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str | None
    processors: list[LogitProcessor]
    callback: OutputCallback
    request_id: str | None
    future: Future


class RequestStream:
    """Iterate a request's outputs in the caller's thread (blocking)."""

    def __init__(self) -> None:
        self.queue: queue.Queue[RequestOutput] = queue.Queue()
        self.request_id = ""

    def put(self, out: RequestOutput) -> None:
        self.queue.put(out)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.queue.get()
            yield out
            if out.finished:
                return


class EngineThread:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Submit | None] = queue.Queue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        callback: OutputCallback,
        *,
        tenant: str | None = None,
        processors: list[LogitProcessor] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; return its id once the engine accepted it."""
        if self._stopping or not self.alive:
            raise EngineStopped("the engine is not running")
        fut: Future = Future()
        self._inbox.put(_Submit(prompt_ids, params, tenant, processors or [], callback,
                                request_id, fut))
        return fut.result()

    def stream(self, prompt_ids: list[int], params: SamplingParams, **kw: object) -> RequestStream:
        s = RequestStream()
        s.request_id = self.submit(prompt_ids, params, s.put, **kw)  # type: ignore[arg-type]
        return s

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def abort_all(self) -> None:
        """Abort every request the thread delivers outputs for (thread-safe)."""
        for rid in list(self._callbacks):
            self.engine.abort(rid)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, abort whatever is still running, and join the thread."""
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def drain(self, timeout: float) -> bool:
        """Stop accepting and wait up to ``timeout`` s for in-flight requests to finish."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._callbacks or not self._inbox.empty():
            if time.monotonic() >= deadline or not self.alive:
                return False
            time.sleep(0.02)
        return True

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                if not self._take_submissions(block=idle):
                    break
                for out in self.engine.step():
                    cb = self._callbacks.get(out.request_id)
                    if out.finished:
                        self._callbacks.pop(out.request_id, None)
                    if cb is not None:
                        self._deliver(cb, out)
        except BaseException as e:  # pragma: no cover - last resort: never hang callers
            log.exception("engine thread crashed")
            self.error = e
        finally:
            self._finish_all("the engine stopped")

    def _take_submissions(self, block: bool) -> bool:
        """Admit queued submissions; return False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            try:
                req = self.engine.add_request(item.prompt_ids, item.params,
                                              request_id=item.request_id, tenant=item.tenant,
                                              processors=item.processors)
            except Exception as e:
                item.future.set_exception(e)
                continue
            self._callbacks[req.request_id] = item.callback
            item.future.set_result(req.request_id)

    def _finish_all(self, reason: str) -> None:
        for rid in list(self._callbacks):
            self.engine.abort(rid)
        if self._callbacks:
            try:
                for out in self.engine.step():
                    cb = self._callbacks.pop(out.request_id, None)
                    if cb is not None:
                        self._deliver(cb, out)
            except Exception:  # pragma: no cover
                log.exception("final step failed")
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and not item.future.done():
                item.future.set_exception(EngineStopped(reason))

    @staticmethod
    def _deliver(cb: OutputCallback, out: RequestOutput) -> None:
        try:
            cb(out)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("output callback failed for %s", out.request_id)
