"""Which requests verify how many draft tokens this step: the load-aware cost gate.

A step of R decoding rows costs T seconds and commits R tokens. Adding one draft
token to a row adds δ seconds (the step-time model's price of one more query token at
that row's context, with its logits row, at the step's size so far: past the model's
compute knee a token costs its whole compute, below it little) and commits, in
expectation, that token's probability of being reached and accepted, g (a
:class:`~ember.spec.speculator.Proposal`'s ``reach``). The step's throughput (tokens
committed per second) rises exactly when g / δ exceeds the throughput it already has.
So draft tokens are added greedily, best ratio first, while that holds — and while the
step stays within its time limit (the tightest TPOT objective) and token budget. A
lone stream has a slow step for one token, so even modest drafts pay; sixteen streams
already commit sixteen tokens per step, so only drafts that are nearly certain still
do, and at high occupancy drafting stops by itself. A request that drafted in its
previous step keeps going at ratio ≥ rate; one that did not must beat the rate by 10%
(hysteresis, so a marginal regime does not flap).

Verify rows beside decode rows cost a fixed extra attention call (the cost model's
``verify_call``), which no single token pays for but many may. So the greedy pass
assumes the call is paid, and the whole grant is then kept only if the step's
throughput with it beats the step without drafts.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Protocol, Self

from ember.spec.speculator import Proposal

HYSTERESIS = 1.1


class Step(Protocol):
    """The step as the gate grows it (the engine's ``StepShape`` is one)."""

    decode_rows: int  # rows decoding one token
    verify_rows: int  # rows verifying drafts

    def with_draft_token(self, context: int) -> Self: ...


class Prices(Protocol):
    """What steps cost (the engine's ``StepCostModel`` is one)."""

    @property
    def verify_call(self) -> float: ...

    def predict(self, shape: Step) -> float: ...

    def token_cost(self, shape: Step, context: int) -> float: ...


def allocate(candidates: Sequence[tuple[object, Proposal, int, bool]], shape: Step,
             costs: Prices, committed: float, limit: float = math.inf,
             budget: int = 1 << 30) -> dict[object, int]:
    """Draft tokens per candidate ``(key, proposal, context, drafted_last_step)``.

    ``shape`` is the step so far (its decoding rows), ``committed`` the tokens it is
    expected to commit without drafts; ``context`` is where the candidate's draft
    starts (its tokens attend to that many positions).
    """
    taken = {key: 0 for key, *_ in candidates}
    heap: list[tuple[float, int, int]] = []
    info = list(candidates)

    grown = shape  # the step with the tokens granted so far

    def push(i: int) -> None:
        key, proposal, context, _ = info[i]
        j = taken[key]
        if j < len(proposal.tokens):
            delta = _delta(costs, grown, context + j)
            heapq.heappush(heap, (-proposal.reach[j] / delta, i, j))

    for i in range(len(info)):
        push(i)
    plain = costs.predict(shape)
    # the verify call is paid if any decode row is left beside the verify rows
    call = costs.verify_call if shape.decode_rows > 1 and not shape.verify_rows else 0.0
    time, gain = plain + call, float(committed)
    while heap and budget > 0:
        neg_ratio, i, j = heapq.heappop(heap)
        key, proposal, context, warm = info[i]
        delta = _delta(costs, grown, context + j)
        rate = gain / time if time > 0 else 0.0
        needed = rate if (warm or j > 0) else rate * HYSTERESIS
        if -neg_ratio <= needed or time + delta > limit:
            continue  # this candidate's later tokens are worth even less
        taken[key] = j + 1
        time += delta
        gain += proposal.reach[j]
        grown = grown.with_draft_token(context + j)
        budget -= 1
        push(i)
    grant = {key: n for key, n in taken.items() if n}
    if call and len(grant) >= shape.decode_rows:
        time -= call  # every decode row became a verify row: one call after all
    if grant and plain > 0 and gain / time <= committed / plain:
        return {}  # the drafts do not pay for the verify call
    return grant


def _delta(costs: Prices, shape: Step, context: int) -> float:
    """Seconds one more query token at ``context`` adds to a step (never free): its
    compute (past the knee, all of it), attention and logits row."""
    return max(costs.token_cost(shape, context), 1e-6)
