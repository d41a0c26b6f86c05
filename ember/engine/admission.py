"""Admission: which prepared requests join the queue, and which leave it unserved.

It keeps the engine's table of live requests by id, refuses a group whose first token
is predicted to miss its TTFT objective (``rejected`` with a ``retry_after``), sheds
waiting requests that can no longer make theirs, applies cancellations, and tracks
the siblings (``n > 1``) that wait to be forked from their first request. The
prediction asks the scheduler, whose prefix lookups are made once per waiting request
per step (the KV manager keeps each for the step, unless the cache changes).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from ember.engine.commit import finish
from ember.engine.forecast import Quote
from ember.engine.intake import InvalidRequest
from ember.engine.request import FinishReason, Request
from ember.engine.scheduler import Scheduler
from ember.errors import EmberError

# Share of a TTFT objective the engine plans for: the rest is for what happens outside
# it (reading and preparing the request, streaming the first token back).
TTFT_MARGIN = 0.9
# Share of it past which a request already admitted is given up (one that passed the
# quote counts as admitted): the objective itself. Between the two is a band where a
# prediction made a step later does not overturn one made at once, so the refusals
# are answered while the request is prepared, not after the engine's next step.
SHED_MARGIN = 1.0
ON_THE_WAY_SECONDS = 30.0  # longest a prepared group counts before it reaches the queue


class QueueFull(EmberError):
    """The waiting queue is at its bound; retry later (the server answers 429)."""


class TenantQueueFull(QueueFull):
    """The tenant's own queue limit (``max_queued``) is reached (the server answers 429
    naming it)."""


class Unattainable(QueueFull):
    """Even the queue ahead of the request already takes it past its TTFT objective
    (the server answers 429 with ``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    def __init__(self, scheduler: Scheduler, max_queue: int) -> None:
        self.scheduler = scheduler
        self.max_queue = max_queue
        self.requests: dict[str, Request] = {}  # live requests by id
        self._fork_parent: dict[str, Request] = {}  # pending sibling id -> its first request
        self._refused: list[Request] = []  # rejected at enqueue, reported at the next step
        self._aborts: set[str] = set()
        self._lock = threading.Lock()  # guards _aborts (abort() comes from any thread)
        self.quote: Quote | None = None  # the last step's, for the preparing threads
        self.quoted_refusals = 0  # refused from the quote, before reaching the engine
        # groups that passed the quote and that it does not hold yet (ahead of whoever
        # is quoted next): request id -> (priority, tenant), prompt tokens, and when to
        # stop counting it (a group dropped on a path that never said so)
        self._on_the_way: dict[str, tuple[tuple[int, str], int, float]] = {}
        # of those, the ones queued since the last quote: the next one counts them
        self._queued_since_quote: list[str] = []
        self._on_the_way_lock = threading.Lock()

    def publish_quote(self) -> None:
        """After a step (engine thread): what a request arriving now would meet. The
        groups queued since the last quote are in this one: they stop counting apart."""
        quote = self.scheduler.forecast.quote()
        with self._on_the_way_lock:  # the quote and the table change together
            self.quote = quote
            for rid in self._queued_since_quote:
                self._on_the_way.pop(rid, None)
            self._queued_since_quote = []

    def check_quote(self, group: list[Request]) -> None:
        """Raise :class:`Unattainable` when the last quote already puts a prepared
        group's first token past its TTFT objective (any thread): the queue ahead of
        it, and what its prompt must compute (what the prefix cache holds of it now)."""
        parent = group[0]
        if parent.slo_ttft is None or self.quote is None:
            return
        own = self.scheduler.kv.uncached_at_least(parent)
        key = (parent.priority, parent.tenant)
        with self._on_the_way_lock:  # the quote with the table as it was published
            quote, now = self.quote, time.monotonic()
            predicted = now - parent.arrival_time + quote.ttft(
                parent.tenant, parent.priority, own, self._tokens_on_the_way(), now)
            late = predicted - TTFT_MARGIN * parent.slo_ttft
            if late <= 0:
                # counted as the queue will count it while it waits (its whole prompt:
                # what the cache holds of it is known once it is scheduled)
                self._on_the_way[parent.request_id] = (key, parent.remaining_prefill,
                                                       now + ON_THE_WAY_SECONDS)
                return
        self.quoted_refusals += 1
        raise Unattainable(f"the request would miss its time-to-first-token objective "
                           f"({parent.slo_ttft:g} s): {predicted:.2f} s predicted", late)

    def arrived(self, group: list[Request], queued: bool = False) -> None:
        """A group that passed the quote will not reach the queue (any thread), or was
        ``queued`` (engine thread): then it counts until the next quote holds it, or
        the requests prepared during the step it joined would not see it."""
        if group and group[0].request_id in self._on_the_way:
            with self._on_the_way_lock:
                if queued:
                    self._queued_since_quote.append(group[0].request_id)
                else:
                    self._on_the_way.pop(group[0].request_id, None)

    def on_the_way(self) -> dict[tuple[int, str], int]:
        """The prompt tokens on their way to the queue, by (priority, tenant)."""
        return self.quoted()[1]

    def quoted(self) -> tuple[Quote | None, dict[tuple[int, str], int]]:
        """The last quote and the prompt tokens on their way beside it, read together
        (any thread)."""
        with self._on_the_way_lock:
            return self.quote, self._tokens_on_the_way()

    def _tokens_on_the_way(self) -> dict[tuple[int, str], int]:
        now, tokens = time.monotonic(), Counter[tuple[int, str]]()
        for rid, (key, n, until) in list(self._on_the_way.items()):
            if until < now:
                del self._on_the_way[rid]
            else:
                tokens[key] += n
        return dict(tokens)

    def check_queue(self, pending: int = 0) -> None:
        """Raise :class:`QueueFull` if the waiting queue (plus ``pending`` prompts that
        are on their way in) leaves no room for one more."""
        if len(self.scheduler.waiting) + pending >= self.max_queue:
            raise QueueFull(f"waiting queue is full ({self.max_queue} requests)")

    def enqueue(self, group: list[Request]) -> None:
        """Queue a prepared group (engine thread only); the first request is scheduled,
        the others fork from it when its prompt is computed. A group whose first token
        is predicted to come after its TTFT objective is refused: it finishes as
        ``rejected`` at the next step, with a ``retry_after``."""
        for req in group:
            if req.request_id in self.requests:
                self.arrived(group)
                raise InvalidRequest("request_id", f"request id {req.request_id!r} is "
                                                   "already in use", req.request_id)
        parent, *siblings = group
        for req in group:
            self.requests[req.request_id] = req
        if parent.slo_ttft is not None:
            waited = time.monotonic() - parent.arrival_time
            predicted = waited + self.scheduler.forecast.predict_ttft(parent)
            margin = SHED_MARGIN if parent.request_id in self._on_the_way else TTFT_MARGIN
            if predicted > margin * parent.slo_ttft:
                self.arrived(group)
                self._refuse(group, predicted - margin * parent.slo_ttft)
                return
        self.arrived(group, queued=True)
        parent.forks = siblings
        for sibling in siblings:
            self._fork_parent[sibling.request_id] = parent
        self.scheduler.add(parent)

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step (any thread)."""
        with self._lock:
            self._aborts.add(request_id)

    def leaving(self) -> list[Request]:
        """At the start of a step: the requests cancelled, shed or refused since the
        last one, each finished (their blocks are released when the engine retires
        them)."""
        gone = self._apply_aborts() + self._shed_hopeless() + self._refused
        for req in self._refused:
            self.requests.pop(req.request_id, None)
        self._refused = []
        return gone

    def forked(self, child: Request) -> None:
        """A sibling left the wait for its fork (forked, or sent to prefill alone)."""
        self._fork_parent.pop(child.request_id, None)

    def retired(self, req: Request) -> None:
        """A finished request whose blocks are released; siblings still waiting for it
        prefill alone."""
        self.requests.pop(req.request_id, None)
        if req.forks:
            for child in req.forks:
                self.forked(child)
            self.scheduler.requeue(req.forks)
            req.forks = []

    def _refuse(self, group: list[Request], retry_after: float) -> None:
        for req in group:
            req.retry_after = retry_after
            finish(req, FinishReason.REJECTED, "the request would miss its "
                   f"time-to-first-token objective ({req.slo_ttft:g} s)")
        self._refused += group

    def _shed_hopeless(self) -> list[Request]:
        """Refuse waiting requests that can no longer start within their TTFT objective:
        serving them would spend capacity on answers that miss anyway."""
        lost = self.scheduler.forecast.hopeless(time.monotonic(), SHED_MARGIN)
        for req in lost:
            req.retry_after = req.slo_ttft
            finish(req, FinishReason.REJECTED, "the request cannot get its first token "
                   f"within its objective ({req.slo_ttft:g} s)")
        return lost

    def _apply_aborts(self) -> list[Request]:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        aborted = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            finish(req, FinishReason.ABORT)
            aborted.append(req)
            parent = self._fork_parent.pop(rid, None)
            if parent is not None:  # a sibling still waiting for its fork: no blocks held
                parent.forks.remove(req)
                self.requests.pop(rid)
        return aborted
