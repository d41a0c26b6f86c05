"""When a waiting request would get its first token: the scheduler's forecast.

Admission asks it twice: before queueing a request with a TTFT objective (refused at
once, 429, when it cannot be met: ``predict_ttft``) and each step for the waiting
requests that can no longer meet theirs (shed: ``hopeless``). Both count the prompt
tokens that would be served first under the scheduler's fair share, at the step
costs the :class:`~ember.engine.costs.StepCostModel` predicts for the steps the
scheduler would build (prompt chunks beside the streams decoding now, within their
TPOT objectives).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ember.engine.costs import StepCostModel, StepShape
from ember.engine.request import Request
from ember.kv.manager import KVCacheManager

MIN_PREFILL = 16  # prompt tokens a step may always carry, whatever the objectives


class Queues(Protocol):
    """What the forecast reads of the scheduler."""

    running: list[Request]
    waiting: list[Request]
    costs: StepCostModel
    kv: KVCacheManager
    max_num_batched_tokens: int

    def step_time_limit(self) -> float: ...


@dataclass(frozen=True)
class Quote:
    """What a request arriving now would meet, as of the last step: the prompt tokens
    queued by (priority, tenant) and the cost of prefilling them beside the streams
    decoding then. The engine thread replaces it whole after every step, so the threads
    that prepare requests (and the HTTP front) read it without a lock and without the
    engine, and refuse a request that cannot make its objective before it costs the
    engine anything (the engine checks again, exactly, when it queues one)."""

    queued: dict[tuple[int, str], int]
    per_step: int  # prompt tokens a full prefill step carries
    full_step: float  # seconds of such a step
    empty_step: float  # seconds of a step with no prompt tokens (its decoding rows)
    at: float | None = None  # when it was made (time.monotonic()); None: just now

    def ttft(self, tenant: str, priority: int = 0, own: int = 0,
             on_the_way: Mapping[tuple[int, str], int] | None = None,
             now: float | None = None) -> float:
        """The seconds from ``now`` until a request of ``tenant`` at ``priority`` with
        ``own`` uncomputed prompt tokens would get its first token: the queue ahead of
        it (with ``on_the_way``: what was admitted since the quote) under fair share,
        prefilled in full steps (the last one in part), less what the engine has
        computed of it since the quote (it went on stepping meanwhile): of the queue the
        quote held, as fair share serves it; never of what came after."""
        quoted = _by_tenant(self.queued, priority)
        if now is not None and self.at is not None and self.full_step > 0:
            served = int(max(0.0, now - self.at) / self.full_step * self.per_step)
            quoted = served_fairly(quoted, served)
        queued = _by_tenant(on_the_way or {}, priority)
        for t, n in quoted.items():
            queued[t] += n
        ahead = fair_share_ahead(queued, tenant, own)
        full, rest = divmod(ahead, self.per_step)
        part = (self.empty_step + (self.full_step - self.empty_step) * rest / self.per_step
                if rest else 0.0)
        return full * self.full_step + part


class Forecast:
    def __init__(self, scheduler: Queues) -> None:
        self.scheduler = scheduler

    def prefill_time(self, tokens: int) -> float:
        """Seconds to compute ``tokens`` queued prompt tokens in the steps the scheduler
        builds next to the streams decoding now: full steps (as many prompt tokens as the
        budget and the time limit allow) and one last step for the rest."""
        step, per_step = self._steps()
        full, rest = divmod(tokens, per_step)
        return full * step(per_step) + (step(rest) if rest else 0.0)

    def quote(self) -> Quote:
        """The state a request arriving now would meet (see :class:`Quote`)."""
        step, per_step = self._steps()
        return Quote(self._prompts_queued(), per_step, step(per_step), step(0),
                     time.monotonic())

    def _steps(self) -> tuple[Callable[[int], float], int]:
        """The predicted seconds of a step carrying n prompt tokens beside the streams
        decoding now, and the most prompt tokens a step may carry."""
        decoding = [r for r in self.scheduler.running if r.remaining_prefill == 1]
        base = StepShape(len(decoding), len(decoding), sum(len(r.token_ids) for r in decoding),
                         decode_rows=len(decoding), logits=len(decoding))
        context = base.attended // max(1, len(decoding))

        def step(n: int) -> float:
            return self.scheduler.costs.predict(base.plus(n, context + n))

        per_step = max(MIN_PREFILL, self.scheduler.max_num_batched_tokens - len(decoding))
        limit = self.scheduler.step_time_limit()
        if limit != math.inf:
            lo, hi = 0, per_step  # the largest chunk that keeps a step within the limit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if step(mid) <= limit else (lo, mid - 1)
            per_step = max(MIN_PREFILL, lo)
        return step, per_step

    def predict_ttft(self, req: Request) -> float:
        """Seconds until ``req`` (not yet queued) would get its first token.

        Its own uncomputed prompt, plus the prompt tokens that would be served before
        it: every queued token of its priority class or better from its own tenant,
        and from each other tenant at most as many as its own tenant has ahead plus
        its own (fair share serves them round by round), at :meth:`prefill_time`.
        """
        queued = _by_tenant(self._prompts_queued(), req.priority)
        own = self._uncached(req)
        return self._eta(queued, req.tenant, own)

    def hopeless(self, now: float, margin: float = 1.0) -> list[Request]:
        """Waiting requests that can no longer get their first token within ``margin`` of
        their TTFT objective: the time they have waited plus the predicted rest exceeds
        it. They are taken in the order they would be served, each counting those
        before it."""
        queued = _by_tenant(self._prompts_queued(running_only=True))
        lost = []
        for req in sorted(self.scheduler.waiting, key=lambda r: (r.priority, r.arrival_time)):
            own = self._uncached(req)
            if req.slo_ttft is not None and req.num_output == 0 and (
                    now - req.arrival_time + self._eta(queued, req.tenant, own)
                    > margin * req.slo_ttft):
                lost.append(req)
                continue
            queued[req.tenant] += own
        return lost

    def _prompts_queued(self, running_only: bool = False) -> dict[tuple[int, str], int]:
        """Prompt tokens still to compute, by (priority, tenant)."""
        queued: dict[tuple[int, str], int] = defaultdict(int)
        sched = self.scheduler
        for r in sched.running if running_only else sched.running + sched.waiting:
            if r.remaining_prefill > 1:
                queued[(r.priority, r.tenant)] += r.remaining_prefill
        return dict(queued)

    def _uncached(self, req: Request) -> int:
        if req.kv_len:
            return req.remaining_prefill
        return len(req.token_ids) - self.scheduler.kv.cached_estimate(req)

    def _eta(self, queued: dict[str, int], tenant: str, own: int) -> float:
        return self.prefill_time(fair_share_ahead(queued, tenant, own))


def _by_tenant(queued: Mapping[tuple[int, str], int],
               priority: float = math.inf) -> dict[str, int]:
    """The tokens queued at ``priority`` or better (default: all), by tenant."""
    tenants: dict[str, int] = defaultdict(int)
    for (p, t), n in queued.items():
        if p <= priority:
            tenants[t] += n
    return tenants


def served_fairly(queued: Mapping[str, int], tokens: int) -> dict[str, int]:
    """What is left of each tenant's ``queued`` tokens once ``tokens`` of them are
    computed under fair share: every tenant at the same pace, until the smaller
    queues run out."""
    level, rest = 0.0, tokens
    by_size = sorted(queued.values())
    for i, q in enumerate(by_size):
        sharing = len(by_size) - i
        if (q - level) * sharing > rest:
            level += rest / sharing
            break
        rest -= int((q - level) * sharing)
        level = q
    return {t: max(0, q - int(level)) for t, q in queued.items()}


def fair_share_ahead(queued: Mapping[str, int], tenant: str, own: int) -> int:
    """Prompt tokens served before a request of ``tenant`` with ``own`` uncomputed
    ones gets its first token, with ``queued`` tokens per tenant ahead: all of its own
    tenant's and its own, and of each other tenant at most as many (fair share serves
    them round by round)."""
    mine = queued.get(tenant, 0) + own
    return mine + sum(min(q, mine) for t, q in queued.items() if t != tenant)
