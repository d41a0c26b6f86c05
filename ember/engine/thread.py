"""EngineThread: one thread owns the engine; callers talk to it through queues.

Callers (the HTTP server's event loop, or any thread) submit requests and receive
each request's outputs through a callback or a thread-safe queue. The model, the
KV pool and the scheduler are only ever touched by the engine thread.

Submitting never waits for the engine. A caller first takes a :class:`Slot` (this
is where a full queue is refused, at once), prepares its requests with
``engine.prepare`` in its own thread (validation, grammar compilation: a bad
request is refused there, also at once), and hands them over with ``Slot.submit``,
which only puts them in the inbox. The engine thread moves them into the scheduler
between steps. A queue of N therefore bounds the requests being prepared, in the
inbox and waiting in the scheduler together, and a burst beyond it gets its
``QueueFull`` in microseconds rather than after the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.engine import embedding
from ember.engine.commit import finish
from ember.engine.engine import LLMEngine
from ember.engine.forecast import Quote
from ember.engine.output import RequestOutput
from ember.engine.request import FinishReason, Request
from ember.engine.slots import OutputCallback, QueuePlaces, Slot
from ember.errors import EmberError
from ember.kv.blocks import KV_DTYPES
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import LogitProcessor

log = logging.getLogger("ember.engine")

T = TypeVar("T")


class EngineStopped(EmberError):
    """The engine thread is not running (shut down or crashed)."""


@dataclass
class _Submit:
    group: list[Request]
    callback: OutputCallback
    tenant: str | None  # whose slot it took (its tenant_limits queue)


@dataclass
class _Call:
    """Something to run on the engine thread, between steps (see EngineThread.call)."""

    fn: Callable[[LLMEngine], Any]
    result: Future


@dataclass
class _Embed:
    """Inputs to embed (token ids each): see EngineThread.embed."""

    inputs: list[list[int]]
    result: Future
    scores: bool  # a reranker's scores, not embeddings


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
        self._inbox: queue.Queue[_Submit | _Call | _Embed | None] = queue.Queue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._lock = threading.Lock()  # guards the three fields below
        # groups admitted to the queue but not yet in the scheduler
        self._places = QueuePlaces(engine.config.limits_for)
        self._in_inbox: set[str] = set()  # ids handed over, not yet enqueued
        self._cancelled: set[str] = set()  # of those, the ones aborted meanwhile
        # embedding requests: a pass per step, as many tokens as a step of generation
        self._embeds = embedding.Batcher(KV_DTYPES[engine.config.kv_dtype],
                                         engine.config.max_num_batched_tokens)
        self._stopping = False
        self.error: BaseException | None = None

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------ callers
    def slot(self, tenant: str | None = None) -> Slot:
        """Take a place in the queue now, for ``tenant`` (its ``max_queued`` limit
        applies); raises ``QueueFull`` or ``EngineStopped``."""
        with self._lock:
            if self._stopping or not self.alive:
                raise EngineStopped("the engine is not running")
            self.engine.check_queue(pending=self._places.count)
            key = self._places.take(tenant, self._tenant_waiting)
        return Slot(self._hand_over, self._release_slot, key)

    def _tenant_waiting(self, tenant: str) -> int:
        return sum(1 for r in list(self.engine.scheduler.waiting) if (r.tenant or "") == tenant)

    def quoted(self) -> tuple[Quote | None, dict[tuple[int, str], int]]:
        """What a request arriving now would meet, as of the last step, and the prompt
        tokens admitted since that quote that it does not hold yet."""
        return self.engine.admission.quoted()

    def queue_full(self) -> bool:
        """Whether :meth:`slot` would raise ``QueueFull`` now (a lock-free read)."""
        waiting = len(self.engine.scheduler.waiting)
        return waiting + self._places.count >= self.engine.config.max_queue

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams | Sequence[SamplingParams],
        callback: OutputCallback,
        *,
        tenant: str | None = None,
        processors: list[LogitProcessor] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Prepare and queue a request (several params: n choices of one prompt, the
        first id is returned); raises QueueFull / InvalidRequest here, in the caller."""
        with self.slot() as slot:
            group = self.engine.prepare(prompt_ids, params, tenant=tenant,
                                        processors=processors or (), request_id=request_id)
            return slot.submit(group, callback)[0]

    def stream(self, prompt_ids: list[int], params: SamplingParams, **kw: object) -> RequestStream:
        s = RequestStream()
        s.request_id = self.submit(prompt_ids, params, s.put, **kw)  # type: ignore[arg-type]
        return s

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps (what must not race
        a step: the prefix cache, say) and return what it returns, or raise what it
        raises."""
        result: Future = Future()
        if self._stopping or not self.alive:
            raise EngineStopped("the engine is not running")
        self._inbox.put(_Call(fn, result))
        return result.result(timeout)

    def embed(self, inputs: list[list[int]], scores: bool = False) -> Future:
        """Embed ``inputs`` (token ids each) on the engine thread, a pass per step
        beside generation, batched with every other embedding request (no KV outlives
        a pass). The future holds one unit vector per input (``scores``: a reranker's
        outputs), or the error."""
        result: Future = Future()
        with self._lock:  # not after the engine's last look at its inbox
            if self._stopping or not self.alive:
                raise EngineStopped("the engine is not running")
            self._inbox.put(_Embed(inputs, result, scores))
        return result

    def cancel_embed(self, result: Future) -> None:
        """Drop the embedding request ``result`` is for before its next pass."""
        self._embeds.cancel(result)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._in_inbox:
                self._cancelled.add(request_id)
                return
        self.engine.abort(request_id)

    def discard(self, group: Sequence[Request]) -> None:
        """Prepared requests that will not be submitted: they hold no engine state until
        handed over, but count in admission's quote until they arrive (a replica set
        must stop them remotely)."""
        if group:
            self.engine.admission.arrived(list(group))

    def metric_lines(self) -> list[str]:
        """Prometheus lines beyond the engine's metrics: none here (a replica set adds
        its replicas' and its router's)."""
        return []

    def purge_cache(self, tenant: str) -> dict[str, int]:
        """Forget ``tenant``'s cached prefixes: RAM between two steps, then the disk
        tier from this thread (see LLMEngine.purge_cache); what was removed."""
        removed = self.call(lambda engine: engine.purge_cache(tenant))
        return {**removed, **self.engine.purge_disk(tenant)}

    def abort_all(self) -> None:
        """Abort every request the thread delivers outputs for (thread-safe)."""
        with self._lock:
            self._cancelled |= self._in_inbox
        for rid in list(self._callbacks):
            self.engine.abort(rid)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting, abort whatever is still running, and join the thread."""
        with self._lock:
            self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def drain(self, timeout: float) -> bool:
        """Stop accepting and wait up to ``timeout`` s for in-flight requests to finish."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self._callbacks or self._places.count:
            if time.monotonic() >= deadline or not self.alive:
                return False
            time.sleep(0.02)
        return True

    def _hand_over(self, group: list[Request], callback: OutputCallback,
                   tenant: str | None) -> list[str]:
        ids = [r.request_id for r in group]
        with self._lock:
            if self._stopping or not self.alive:
                self._places.give_back(tenant)
                self.discard(group)  # it will not reach the queue: stop counting it
                raise EngineStopped("the engine is not running")
            self._in_inbox.update(ids)
        self._inbox.put(_Submit(group, callback, tenant))
        return ids

    def _release_slot(self, key: str | None) -> None:
        with self._lock:
            self._places.give_back(key)

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished() and not self._embeds.pending
                if not self._take_submissions(block=idle):
                    break
                if self._embeds.pending:
                    self._embeds.step(self.engine.loaded.model)
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
            self._finish_all()
            self.engine.close()

    def _take_submissions(self, block: bool) -> bool:
        """Move handed-over groups into the engine; return False when asked to stop."""
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, _Call):
                self._run_call(item)
            elif isinstance(item, _Embed):
                if item.result.set_running_or_notify_cancel():
                    self._embeds.add(self.engine.loaded.model, item.inputs, item.result,
                                     item.scores)
            else:
                self._enqueue(item)

    def _run_call(self, item: _Call) -> None:
        try:
            item.result.set_result(item.fn(self.engine))
        except Exception as e:  # the caller's to handle
            item.result.set_exception(e)

    def _enqueue(self, item: _Submit) -> None:
        ids = [r.request_id for r in item.group]
        try:
            self.engine.enqueue(item.group)
        except Exception as e:  # a duplicate caller-chosen id: fail the group in-band
            for req in item.group:
                finish(req, FinishReason.ERROR, str(e))
                self._deliver(item.callback, self.engine.output(req))
            ids = []
        for req in item.group:
            if req.finish_reason is FinishReason.REJECTED:  # answered now, not a step later
                self._deliver(item.callback, self.engine.output(req))
                ids = [i for i in ids if i != req.request_id]
        for rid in ids:
            self._callbacks[rid] = item.callback
        with self._lock:
            self._places.give_back(item.tenant)
            self._in_inbox.difference_update(r.request_id for r in item.group)
            cancelled = self._cancelled.intersection(ids)
            self._cancelled.difference_update(cancelled)
        for rid in cancelled:
            self.engine.abort(rid)

    def _finish_all(self) -> None:
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
        with self._lock:
            self._stopping = True
        self._embeds.fail_all(EngineStopped("the engine stopped"))
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Call | _Embed):
                if not item.result.done():  # (a caller may have cancelled it)
                    item.result.set_exception(EngineStopped("the engine stopped"))
            elif item is not None:  # handed over as the engine stopped: ends like the rest
                for req in item.group:
                    finish(req, FinishReason.ABORT)
                    self._deliver(item.callback, self.engine.output(req))

    @staticmethod
    def _deliver(cb: OutputCallback, out: RequestOutput) -> None:
        try:
            cb(out)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("output callback failed for %s", out.request_id)

