"""Continuous batching: which requests run this step, and how many tokens each.

Each step fills a token budget (``max_num_batched_tokens``):

1. running requests that are decoding, one token each, oldest first;
2. running requests still prefilling, a chunk each (chunked prefill);
3. waiting requests, admitted in arrival order while ``max_num_seqs`` and the
   KV pool allow, each with a first prefill chunk.

When the pool cannot hold a running request's next token, the most recently
admitted running request is preempted by recompute: its blocks are released and
it returns to the front of the waiting queue, to be prefilled again later (its
committed tokens are kept, so its output is unchanged).

Cost per step is proportional to the number of requests, not their lengths.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.engine.request import Request, RequestStatus
from ember.engine.runner import ScheduledRow
from ember.kv.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admitted = 0
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove_finished(self) -> list[Request]:
        """Drop finished requests from both queues and release their blocks."""
        done = [r for r in self.running if r.is_finished]
        done += [r for r in self.waiting if r.is_finished]
        if done:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
            for req in done:
                self.kv.free(req)
        return done

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1 + 2: running requests, decoders before prefills, oldest admitted first.
        for req in sorted(self.running, key=lambda r: (r.remaining_prefill > 1, r.admitted_seq)):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.remaining_prefill, budget)
            if not self._reserve_or_preempt(req, n, out):
                continue
            out.rows.append(ScheduledRow(req, n))
            budget = self.max_num_batched_tokens - out.num_tokens
        # 3: admit waiting requests.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.kv_len == 0:
                self.kv.match_prefix(req)
            n = min(req.remaining_prefill, budget)
            if not self.kv.can_reserve(req, req.kv_len + n):
                # Give the matched prefix back: a waiting request must hold no blocks,
                # or two of them can each hold what the other needs and wait forever.
                self.kv.free(req)
                break  # admission waits for blocks; the engine rejects requests that never fit
            self.waiting.popleft()
            self.kv.reserve(req, req.kv_len + n)
            req.status = RequestStatus.RUNNING
            self._admitted += 1
            req.admitted_seq = self._admitted
            self.running.append(req)
            out.rows.append(ScheduledRow(req, n))
            budget -= n
        return out

    def _reserve_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Reserve KV for ``n`` more tokens of ``req``, preempting newer requests if needed."""
        while not self.kv.can_reserve(req, req.kv_len + n):
            victim = max(
                (r for r in self.running if r.status is RequestStatus.RUNNING),
                key=lambda r: r.admitted_seq,
            )
            self._preempt(victim, out)
            if victim is req:
                return False
        self.kv.reserve(req, req.kv_len + n)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        # Remove it from rows already scheduled this step (it is the newest, so it may be).
        out.rows = [r for r in out.rows if r.request is not req]
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions += 1
