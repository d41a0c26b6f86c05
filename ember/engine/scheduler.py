"""Continuous batching: which requests run this step, and how many tokens each.

Each step fills a token budget (``max_num_batched_tokens``):

1. running requests that are decoding, one token each, oldest first;
2. prompt chunks — of running requests still prefilling and of waiting requests
   being admitted — handed out in rounds: by priority class first (a lower
   ``priority`` number first), then to the tenant with the least service so far
   (weighted fair share), and within a tenant to its oldest request. A chunk is at
   most ``max_prefill_chunk`` tokens, and one request gets one chunk per round;
3. budget left over tops up this step's chunks, in the same order.

Stall-free prefill: when running streams have a time-per-output-token objective,
the step's prompt tokens are limited so that the step's predicted duration (from
the :class:`~ember.engine.costs.StepCostModel`, which learns from the steps that
run) stays within the tightest such objective. A prompt never stalls the streams
that are decoding; at least :data:`MIN_PREFILL` prompt tokens still run per step so
admission always makes progress. A new stream is only admitted while the streams
already decoding, plus it, fit that objective.

Fairness is by service, not by arrival: a tenant that sends a burst has all its
requests served one after another in its own turn, while another tenant's request
is served in the next round. A tenant's service counter is raised to the least
counter of the active tenants when it becomes active again, so idle time is not
banked.

When the pool cannot hold a running request's next token, the running request of
lowest priority (newest first among equals, a tenant holding more than an equal share
of the pool before one that does not) is preempted by recompute: its blocks are
released and it returns to the waiting queue, to be prefilled again later (its
committed tokens are kept, so its output is unchanged). The running request first in
line (by priority, then arrival) is never preempted for another, so it always
progresses: no set of requests can preempt each other in turn forever. Waiting requests hold no
blocks, so two of them can never each hold what the other needs.

Cost per step is proportional to the number of requests, not their lengths.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.engine.costs import StepCostModel, StepShape
from ember.engine.forecast import MIN_PREFILL, Forecast
from ember.engine.pace import Pace
from ember.engine.request import FinishReason, Request, RequestStatus
from ember.engine.runner import ScheduledRow
from ember.kv.manager import KVCacheManager
from ember.spec.gate import allocate
from ember.spec.speculator import Proposal

# Requests part-way through their prompt at once. Spreading a step's prompt tokens over
# many prompts makes every one of them late; finishing two at a time keeps TTFT short
# (one more would let a long prompt of one tenant not block another's short one).
PARTIAL_PREFILLS = 2
STALL_MARGIN = 0.9  # fraction of the tightest TPOT objective a step may take
SEAT_MARGIN = 0.7  # fraction of it the decode rows alone may take (room for prefill)
FIRST_TOKEN_SHARE = 0.5  # of the prefill step limit, for a step that gives a first token
# A prefill's chunk may grow at most this much from one step to the next. The scheduler
# sizes chunks to the step cost model's prediction, so the steps it learns from all sit
# on one predicted duration and tell it little about bigger chunks: a refit can move its
# belief about them a lot, and an unbounded next chunk then takes twice the step limit
# (measured: 129 -> 229 tokens, 0.5 s predicted, 0.96 s taken, four steps in a row).
CHUNK_GROWTH = 1.25


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    shape: StepShape = field(default_factory=lambda: StepShape(0, 0, 0))

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None = None,
                 costs: StepCostModel | None = None,
                 max_running: Callable[[str], int | None] = lambda tenant: None,
                 max_prefill_step_seconds: float = math.inf,
                 kv_cap: Callable[[str], int | None] = lambda tenant: None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max(1, max_num_batched_tokens // 4)
        self.costs = costs or StepCostModel()
        self.max_running = max_running  # per tenant (None: only max_num_seqs)
        self.kv_cap = kv_cap  # per tenant: KV blocks its running requests hold (None: any)
        self.max_prefill_step_seconds = max_prefill_step_seconds
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.served: dict[str, float] = defaultdict(float)  # weighted tokens per tenant
        self._admitted = 0
        self.num_preemptions = 0
        self.forecast = Forecast(self)
        self.pace = Pace()  # the share of TPOT objectives steps are planned to

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self._activate(req.tenant)
        self.waiting.append(req)

    def requeue(self, reqs: list[Request]) -> None:
        """Put requests (that hold no blocks) back among the waiting."""
        self.waiting.extend(reqs)

    def remove_finished(self) -> list[Request]:
        """Drop finished requests from both queues and release their blocks."""
        done = [r for r in self.running if r.is_finished]
        done += [r for r in self.waiting if r.is_finished]
        now = time.monotonic()
        for req in done:
            if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.pace.observe_finished(req.first_token_time, now, req.num_output,
                                           req.slo_tpot)
        if done:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = [r for r in self.waiting if not r.is_finished]
            for req in done:
                self.kv.free(req)
        return done

    def start_running(self, req: Request) -> None:
        """Make a request that holds its blocks (admitted, or forked) a running one."""
        req.status = RequestStatus.RUNNING
        self._admitted += 1
        req.admitted_seq = self._admitted
        if req.admitted_time is None:
            req.admitted_time = time.monotonic()
        self.running.append(req)

    # ------------------------------------------------------------ the step
    def schedule(self, propose: Callable[[], dict[Request, Proposal]] | None = None
                 ) -> SchedulerOutput:
        """This step's rows; ``propose()`` gives drafts of decoding requests, of which the
        cost gate (``ember.spec.gate``) verifies as many tokens as pay for themselves. It
        is not even asked when no draft could pay (see :meth:`_drafts_can_pay`)."""
        out = SchedulerOutput()
        decoding = sorted((r for r in self.running if r.remaining_prefill == 1),
                          key=lambda r: r.admitted_seq)
        for req in decoding:
            if req.status is RequestStatus.RUNNING and self._reserve_or_preempt(req, 1, out):
                self._add_row(out, req, 1)
        limit = self.step_time_limit()
        if propose is not None:
            if self._drafts_can_pay(out):
                proposals = propose()
                if proposals:
                    self._add_drafts(out, proposals, limit)
            else:
                for row in out.rows:
                    spec = row.request.speculator
                    if spec is not None:
                        spec.granted(0)
                        spec.stats.off_steps += 1
        # prompt chunks are also sized to keep the step short: a request arriving while a
        # long prompt prefills waits for one such step, not one of the full token budget
        # at a long context (seconds on a CPU); seats and drafts keep the TPOT limit only
        prefill_limit = min(limit, self.max_prefill_step_seconds)
        # when a short prompt can finish in this step, long prompts get only a share of
        # the limit in it, so a short request that arrived during a long prefill waits
        # for the step then running plus a short one, not two long ones
        long_share = FIRST_TOKEN_SHARE if self._first_token_due() else 1.0
        self._hand_out_prompt_tokens(out, limit, prefill_limit, long_share)
        self._top_up(out, prefill_limit, long_share)
        for row in out.rows:
            if not row.samples or row.num_tokens > 1:  # a prompt chunk
                row.request.last_chunk = row.num_tokens
        return out

    def _add_drafts(self, out: SchedulerOutput, proposals: dict[Request, Proposal],
                    limit: float) -> None:
        """Give decoding rows the draft tokens the gate says pay, where KV allows."""
        where = {row.request: i for i, row in enumerate(out.rows)}
        candidates = [(req, p, len(req.token_ids), req.speculator.warm)  # type: ignore[union-attr]
                      for req, p in proposals.items() if req in where]
        grant = allocate(candidates, out.shape, self.costs, committed=len(out.rows),
                         limit=limit, budget=self.max_num_batched_tokens - out.num_tokens)
        for req, proposal in proposals.items():
            k = grant.get(req, 0)
            if k and not (self.kv.can_reserve(req, req.kv_len + 1 + k)
                          and self._tenant_fits(req, req.kv_len + 1 + k)):
                k = 0
            req.speculator.granted(k)  # type: ignore[union-attr]
            if not k:
                if req in where:
                    req.speculator.stats.off_steps += 1  # type: ignore[union-attr]
                continue
            self.kv.reserve(req, req.kv_len + 1 + k)
            out.rows[where[req]] = ScheduledRow(req, 1, proposal.tokens[:k], proposal)
            self._charge(req, k)
        out.shape = _shape_of(out.rows)

    def _drafts_can_pay(self, out: SchedulerOutput) -> bool:
        """Whether a draft token accepted for certain would raise this step's throughput:
        its cost at the shortest context, times the tokens per second the step commits
        without drafts, below one. Sixteen streams of a small model on a few cores are
        compute-bound: every token costs its full compute there, no draft pays, and
        proposing and feeding drafts is pure cost (5% of SmolLM2's throughput)."""
        contexts = [len(row.request.token_ids) for row in out.rows
                    if row.samples and row.request.speculator is not None]
        if not contexts:
            return False
        seconds = self.costs.predict(out.shape)
        return seconds <= 0 or len(out.rows) * self.costs.token_cost(
            out.shape, min(contexts)) < seconds

    def prefill_step_limit(self) -> float:
        """The longest a step carrying prompt tokens may take now."""
        return min(self.step_time_limit(), self.max_prefill_step_seconds)

    def step_time_limit(self) -> float:
        """The step duration that keeps every decoding stream within its TPOT objective."""
        tpots = [r.slo_tpot for r in self.running
                 if r.slo_tpot is not None and r.remaining_prefill == 1]
        return STALL_MARGIN * self.pace.scale * min(tpots) if tpots else math.inf

    def _hand_out_prompt_tokens(self, out: SchedulerOutput, limit: float,
                                prefill_limit: float, long_share: float) -> None:
        """2: prompt chunks in rounds — priority class, then least-served tenant."""
        queues = self._prompt_queues()
        can_admit = True
        self._partial = sum(1 for r in self.running if r.remaining_prefill > 1)
        running: dict[str, int] = defaultdict(int)
        for r in self.running:
            running[r.tenant] += 1
        while queues:
            key = min(queues, key=lambda k: (k[0], self._service(k[1])))
            req = queues[key].pop(0)
            if not queues[key]:
                del queues[key]
            if req.status is RequestStatus.WAITING:
                if not can_admit or self.kv.loading(req):
                    continue  # a prefix being read from disk holds up only its own request
                cap, now = self.max_running(req.tenant), running[req.tenant]
                if cap is not None and now and now + req.group_size > cap:
                    continue  # its tenant's limit: it waits, nobody else's turn is held up
                if now and not self._tenant_fits(req, len(req.token_ids)):
                    continue  # its prompt would take its tenant past its KV share
                if not self._admit(req, out, limit,
                                   self._prompt_limit(req, prefill_limit, long_share)):
                    can_admit = False  # blocked: later arrivals may not overtake it
                    continue
                running[req.tenant] += req.group_size
            elif req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            else:
                n = min(self._chunk(req, out, self._prompt_limit(req, prefill_limit, long_share),
                                    floor=MIN_PREFILL),
                        self._growth_cap(req))
                if n == 0 or not self._reserve_or_preempt(req, n, out):
                    continue
                self._add_row(out, req, n)
            if out.num_tokens >= self.max_num_batched_tokens:
                return

    def _prompt_queues(self) -> dict[tuple[int, str], list[Request]]:
        """Requests that want prompt tokens, per (priority, tenant): those whose prompt
        fits in one chunk first, then the longer ones; each kind oldest first, running
        ones before waiting ones, so a tenant finishes what it started. A short request
        arriving while a long prompt of the same tenant prefills is not held behind it
        (the long one still gets MIN_PREFILL tokens a step)."""
        queues: dict[tuple[int, str], list[Request]] = defaultdict(list)
        prefilling = [r for r in self.running if r.remaining_prefill > 1]
        ordered = sorted(prefilling, key=lambda r: r.admitted_seq) + sorted(
            self.waiting, key=lambda r: (r.arrival_time, r.request_id))
        for req in sorted(ordered, key=lambda r: r.remaining_prefill > self.max_prefill_chunk):
            queues[(req.priority, req.tenant)].append(req)
        return dict(queues)

    def _admit(self, req: Request, out: SchedulerOutput, limit: float,
               prefill_limit: float) -> bool:
        """Admit a waiting request with its first chunk, if seats, KV and time allow
        (``limit``: the TPOT objectives' step time; ``prefill_limit``: its chunk's)."""
        if self._seats() + req.group_size > self.max_num_seqs:
            return False
        if not self._seat_fits(req, limit):
            return False
        found = self.kv.probe_prefix(req)
        cached = len(found) * self.kv.block_size
        n = self._chunk(req, out, prefill_limit, start=cached)
        partial = cached + n < len(req.token_ids)
        if n == 0 or (partial and self._partial >= PARTIAL_PREFILLS):
            return False
        if not self.kv.can_admit(found, cached + n):
            return False
        self._partial += partial
        self.waiting.remove(req)
        self.kv.admit(req, found, cached + n)
        req.timeline.restored_bytes += self.kv.take_restored(req.request_id)
        self.start_running(req)
        self._add_row(out, req, n)
        return True

    def _seat_fits(self, req: Request, limit: float) -> bool:
        """Whether one more decoding stream keeps the decode rows within the objective
        (the candidate's own TPOT objective counts too)."""
        if req.slo_tpot is not None:
            limit = min(limit, STALL_MARGIN * self.pace.scale * req.slo_tpot)
        if limit == math.inf or not self.running:
            # an idle engine runs it whatever the model predicts: the request cannot
            # wait for ever on a prediction only the steps it would run can correct
            return True
        rows = self._seats() + req.group_size
        context = sum(len(r.token_ids) for r in self.running) + len(req.token_ids)
        decode_only = self.costs.predict(StepShape(rows, rows, context, decode_rows=rows,
                                                   logits=rows))
        return decode_only <= SEAT_MARGIN * limit / STALL_MARGIN

    def _chunk(self, req: Request, out: SchedulerOutput, limit: float,
               start: int | None = None, floor: int | None = None) -> int:
        """Prompt tokens ``req`` may run now: its chunk cap, the budget, and the time limit
        (``floor``: at least that many, whatever the limit — a running prefill's)."""
        start = req.kv_len if start is None else start
        n = min(len(req.token_ids) - start, self.max_prefill_chunk,
                self.max_num_batched_tokens - out.num_tokens)
        return self._fit_time(out, start, n, limit, floor)

    def _fit_time(self, out: SchedulerOutput, start: int, n: int, limit: float,
                  floor: int | None = None) -> int:
        """The most of ``n`` tokens from ``start`` that keeps the step within ``limit``
        (``floor``: a least number of tokens; default: what makes the step's prompt
        tokens MIN_PREFILL)."""
        if n <= 0 or limit == math.inf:
            return max(n, 0)
        if floor is None:
            prompt_so_far = out.num_tokens - sum(1 for r in out.rows if r.num_tokens == 1)
            floor = MIN_PREFILL - prompt_so_far
        floor = max(0, min(n, floor))

        def fits(k: int) -> bool:
            return self.costs.predict(out.shape.plus(k, start + k)) <= limit

        if fits(n):
            return n
        lo, hi = 0, n  # fits(lo) is assumed; hi does not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return max(lo, floor)

    def _top_up(self, out: SchedulerOutput, limit: float, long_share: float) -> None:
        """3: budget nobody else could use goes to this step's prompt chunks."""
        for i, row in enumerate(out.rows):
            budget = self.max_num_batched_tokens - out.num_tokens
            if budget == 0:
                return
            req = row.request
            if row.num_tokens == 1 and req.remaining_prefill == 1:
                continue  # a decode row
            start = req.kv_len + row.num_tokens
            shrunk = SchedulerOutput(out.rows[:i] + out.rows[i + 1:])
            shrunk.shape = _shape_of(shrunk.rows)
            extra = self._fit_time(shrunk, req.kv_len,
                                   min(req.remaining_prefill, row.num_tokens + budget,
                                       self._growth_cap(req)),
                                   self._prompt_limit(req, limit, long_share)) - row.num_tokens
            if extra > 0 and self.kv.can_reserve(req, start + extra) and self._tenant_fits(
                    req, start + extra):
                self.kv.reserve(req, start + extra)
                out.rows[i] = ScheduledRow(req, row.num_tokens + extra)
                self._charge(req, extra)
                out.shape = _shape_of(out.rows)

    # ------------------------------------------------------------ bookkeeping
    def _seats(self) -> int:
        """Sequences running, counting the siblings still to be forked from them."""
        return sum(r.group_size for r in self.running)

    def _add_row(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.rows.append(ScheduledRow(req, n))
        out.shape = out.shape.plus(n, req.kv_len + n)
        self._charge(req, n)

    def _prompt_limit(self, req: Request, limit: float, long_share: float) -> float:
        """The step time ``req``'s prompt chunk may fill: a long prompt's is cut to
        ``long_share`` of it while a short one can finish (see :meth:`schedule`)."""
        return limit * long_share if req.remaining_prefill > self.max_prefill_chunk else limit

    def _first_token_due(self) -> bool:
        """Whether a request still to get its first token has a prompt that fits in one
        chunk, while another prompt is part-way through its prefill."""
        if not any(r.remaining_prefill > self.max_prefill_chunk for r in self.running):
            return False
        return any(r.num_output == 0 and 1 < r.remaining_prefill <= self.max_prefill_chunk
                   for r in self.waiting + self.running)

    @staticmethod
    def _growth_cap(req: Request) -> int:
        """The most prompt tokens a running prefill may take this step (CHUNK_GROWTH)."""
        if not req.last_chunk:
            return req.remaining_prefill
        return max(MIN_PREFILL, int(CHUNK_GROWTH * req.last_chunk))

    def _charge(self, req: Request, tokens: int) -> None:
        self.served[req.tenant] += tokens / req.weight

    def _service(self, tenant: str) -> float:
        return self.served[tenant]

    def _activate(self, tenant: str) -> None:
        """A tenant with nothing queued or running starts at the least active counter."""
        active = {r.tenant for r in self.running} | {r.tenant for r in self.waiting}
        if tenant not in active and active:
            self.served[tenant] = max(self.served[tenant],
                                      min(self.served[t] for t in active))

    def _reserve_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Reserve KV for ``n`` more tokens of ``req``, preempting others if needed: the
        newest of its own tenant where that tenant would pass its KV share, else (the
        pool is full) the newest of the lowest priority, taking first from tenants
        holding more than an equal share of the pool."""
        while not self._tenant_fits(req, req.kv_len + n):
            victim = max((r for r in self.running
                          if r.tenant == req.tenant and r.status is RequestStatus.RUNNING),
                         key=lambda r: r.admitted_seq)
            self._preempt(victim, out)
            if victim is req:
                return False
        first = self._first_in_line()
        while not self.kv.can_reserve(req, req.kv_len + n):
            held = self._held_blocks()
            fair = self.kv.num_blocks / max(1, len(held))
            victim = max(
                (r for r in self.running
                 if r.status is RequestStatus.RUNNING and (r is not first or r is req)),
                key=lambda r: (r is not first, r.priority, held[r.tenant] > fair,
                               r.admitted_seq),
            )
            self._preempt(victim, out)
            if victim is req:
                return False
        self.kv.reserve(req, req.kv_len + n)
        return True

    def _first_in_line(self) -> Request | None:
        """The running request that is never preempted for another: the first by
        priority, then arrival. It always makes progress, so requests cannot take turns
        preempting each other forever (by the share rule alone they can: the one that
        has grown past its tenant's share, closest to finishing, is the one preempted,
        then the other). Arrival, unlike admission order, survives a preemption."""
        running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return min(running, key=lambda r: (r.priority, r.arrival_time, r.request_id),
                   default=None)

    def _held_blocks(self) -> dict[str, int]:
        """KV blocks the running requests hold, per tenant (each request's own count:
        a block two of them share counts twice)."""
        held: dict[str, int] = defaultdict(int)
        for r in self.running:
            held[r.tenant] += len(r.block_table.blocks)
        return held

    def _tenant_fits(self, req: Request, n_tokens: int) -> bool:
        """Whether ``req`` holding ``n_tokens`` positions keeps its tenant within its KV
        share (what it holds already counts)."""
        cap = self.kv_cap(req.tenant)
        if cap is None:
            return True
        others = sum(len(r.block_table.blocks) for r in self.running
                     if r.tenant == req.tenant and r is not req)
        return others + max(len(req.block_table.blocks), self.kv.blocks_for(n_tokens)) <= cap

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        # Remove it from rows already scheduled this step (it is the newest, so it may be).
        out.rows = [r for r in out.rows if r.request is not req]
        out.shape = _shape_of(out.rows)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self.waiting.append(req)  # its arrival time keeps it at the front of its tenant
        self.num_preemptions += 1


def _shape_of(rows: list[ScheduledRow]) -> StepShape:
    shape = StepShape(0, 0, 0)
    for row in rows:
        shape = shape.plus(row.num_query, row.request.kv_len + row.num_query, row.num_logits,
                           len(row.draft))
    return shape
