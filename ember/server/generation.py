"""A generation request's outputs, from the engine to its route: the admitted groups
handed over, ``(choice, output)`` pairs as they come, a failed output turned into the
API error it is, the request's latency metrics and trace recorded, and whatever still
runs aborted when the client goes away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ember.engine.output import RequestOutput
from ember.server import render as R
from ember.server.backend import Backend, Handle, PreparedGroup, Submission
from ember.server.errors import APIError, as_api_errors, failure, unattainable
from ember.server.metrics import Metrics
from ember.server.telemetry import RequestRecord, Telemetry
from ember.server.transport import ClientGone


@dataclass
class Admitted:
    """A validated, prepared generation request holding its places in the queue."""

    req: Any  # the protocol body
    groups: list[PreparedGroup]  # one per prompt: its n choices
    slots: list[Submission]
    names: dict[str, str]
    discard: Callable[[list[Any]], None] = lambda work: None
    shape: R.Shape = R.Shape()
    record: RequestRecord | None = None  # for its trace and log line

    def release(self) -> None:
        """Give back the queue places, and the groups never handed over."""
        for group, slot in zip(self.groups, self.slots, strict=False):
            if slot.open:
                self.discard(group.work)
        for slot in self.slots:
            slot.release()


class Streams:
    def __init__(self, metrics: Metrics, telemetry: Telemetry) -> None:
        self.metrics, self.telemetry = metrics, telemetry

    def start(self, adm: Admitted, thread: Backend, watch: Callable[[], asyncio.Future]
              ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Hand the admitted groups to ``thread`` now; iterate ``(choice index, output)``.
        ``watch()``: a future done when the client disconnects (started once they are
        handed over).

        Choice ``i`` is choice ``i % n`` of prompt ``i // n``. A failed output becomes
        an APIError (400 when the request's own parameter caused it, else 500).
        Leaving the iteration early aborts whatever is still running.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        reqs = [h for group in adm.groups for h in group.handles]
        where = {r.request_id: i for i, r in enumerate(reqs)}

        def deliver(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (where[out.request_id], out))

        submitted: list[Handle] = []
        try:
            with as_api_errors(adm.names):
                for group, slot in zip(adm.groups, adm.slots, strict=True):
                    slot.submit(group.work, deliver)
                    submitted += group.handles
        except BaseException:
            adm.release()
            for r in submitted:
                thread.abort(r.request_id)
            raise
        return self._outputs(reqs, queue, thread, adm.names, watch(), adm.record)

    async def _outputs(self, reqs: list[Handle], queue: asyncio.Queue,
                       thread: Backend, names: dict[str, str], gone: asyncio.Future,
                       record: RequestRecord | None = None
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        open_choices = set(range(len(reqs)))
        timings = {i: _Timing() for i in open_choices}
        latest: dict[int, RequestOutput] = {}
        status, error_type = 200, None
        try:
            while open_choices:
                i, out = await _next(queue, gone)
                timings[i].seen(out)
                latest[i] = out
                if out.finished:
                    open_choices.discard(i)
                    self._observe(timings[i], out, reqs[i])
                    if out.finish_reason == "rejected":
                        raise unattainable(out)
                    if out.finish_reason == "error":
                        raise failure(out, names)
                yield i, out
        except APIError as e:
            status, error_type = e.status, e.code or e.type
            raise
        except (ClientGone, GeneratorExit, asyncio.CancelledError):
            status, error_type = 499, "client_disconnected"
            raise
        except BaseException as e:
            status, error_type = 500, type(e).__name__
            raise
        finally:
            gone.cancel()
            end = time.monotonic()
            for i in open_choices:  # the client went away (or a sibling failed)
                thread.abort(reqs[i].request_id)
                done = latest[i].completion_tokens if i in latest else 0
                self.metrics.observe_request(timings[i].ttft, timings[i].itls,
                                             end - timings[i].start,
                                             reqs[i].num_prompt, done, "abort")
            if record is not None:
                self.telemetry.finished(record, [latest.get(i) for i in range(len(reqs))],
                                        status, error_type, end)

    def _observe(self, t: _Timing, out: RequestOutput, req: Handle) -> None:
        self.metrics.observe_request(t.ttft, t.itls, time.monotonic() - t.start,
                                     out.prompt_tokens, out.completion_tokens,
                                     out.finish_reason or "error", out.queued_seconds)
        if req.slo_ttft is not None or req.slo_tpot is not None:
            self.metrics.observe_slo(_met(t, out, req))


async def _next(queue: asyncio.Queue, gone: asyncio.Future) -> tuple[int, RequestOutput]:
    """The next output, or ClientGone as soon as the client disconnects."""
    getter = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        raise ClientGone()
    finally:
        getter.cancel()


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


def _met(t: _Timing, out: RequestOutput, req: Handle) -> bool:
    """Whether a finished request met its objectives, as its client saw them."""
    if out.finish_reason not in ("stop", "length") or t.ttft is None:
        return False
    if req.slo_ttft is not None and t.ttft > req.slo_ttft:
        return False
    if req.slo_tpot is not None and out.completion_tokens > 1 and t.last is not None:
        tpot = (t.last - t.first) / (out.completion_tokens - 1)  # type: ignore[operator]
        return tpot <= req.slo_tpot
    return True
