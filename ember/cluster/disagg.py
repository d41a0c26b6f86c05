"""Prefill/decode disaggregation: when handing a prompt's prefill to another replica pays.

A long prompt prefilled on the replica that will decode it stalls every stream that
replica is decoding: each of its steps carries a prompt chunk, so each stream's next
token waits for it (chunked prefill bounds one step's stall, not their sum). Prefilling
on another replica and handing the KV over removes that stall, and costs the transfer
of the KV, the extra round trips, the wait in the other replica's queue and, when a
handoff fails, the prefill done for nothing. Disaggregate only when the gain exceeds
the cost (seed chapter 10, eq. 10.7)::

    ΔI + ΔS  >  T_KV + T_R + T_Q + T_F

All terms are seconds, measured or predicted here for one request and one pair of
replicas (prefill ``P``, decode ``D``):

- ``ΔI`` interference saved: the stall the prefill would add to each stream decoding
  on ``D`` (less the stall of loading the handed-over blocks there), times those
  streams, minus the stall it adds to the streams ``P`` decodes (a prefill replica that
  is decoding streams of its own moves the stall there rather than removing it). Stalls
  come from each replica's step cost model (:mod:`ember.engine.costs`).
- ``ΔS`` specialisation: how much sooner the prompt is computed on ``P`` than on ``D``
  (fewer decoding streams beside its chunks; ember's replicas run the same kernels on
  the same cores, so that is all it is here).
- ``T_KV`` transfer: the handed-over KV bytes over the bandwidth measured on earlier
  handoffs (fetching, checking and loading the blocks on ``D``).
- ``T_R`` coordination: the measured overhead of the extra hop (the front's round trip
  to ``P`` beyond the prefill's own time in ``P``'s engine).
- ``T_Q`` queue imbalance: how much longer this prompt would wait behind ``P``'s queued
  prompt tokens than behind ``D``'s.
- ``T_F`` failure: the observed rate of failed handoffs times what a failure wastes
  (the prefill on ``P`` and its transfer; ``D`` then recomputes).

:func:`decide` is the rule; :class:`Planner` measures the terms, picks the prefill
replica for a request and learns from each handoff.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ember.engine.costs import Coefficients, StepCostModel, StepShape
from ember.prometheus import family

BANDWIDTH_PRIOR = 1e9  # bytes/s until a handoff has been measured (a local object store)
COORDINATION_PRIOR = 0.005  # seconds of extra round trip until one has been measured
FAILURE_PRIOR = (0.5, 50.0)  # (failures, handoffs) assumed before any is observed
EWMA = 0.2  # weight of the newest observation of bandwidth and coordination (the
# first observations are averaged: one measured handoff outweighs any prior)
MIN_CHUNK = 16  # prompt tokens a step always carries (the scheduler's MIN_PREFILL)
POLICIES = ("rule", "always")  # always: static disaggregation, to compare the rule with
TERMS = ("interference_saved", "specialization", "transfer", "coordination",
         "queue_imbalance", "failure")


@dataclass(frozen=True)
class Terms:
    """The terms of eq. 10.7 for one request, in seconds."""

    interference_saved: float  # ΔI
    transfer: float  # T_KV
    coordination: float  # T_R
    queue_imbalance: float = 0.0  # T_Q
    failure: float = 0.0  # T_F
    specialization: float = 0.0  # ΔS

    @property
    def gain(self) -> float:
        return self.interference_saved + self.specialization

    @property
    def cost(self) -> float:
        return self.transfer + self.coordination + self.queue_imbalance + self.failure

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def decide(terms: Terms) -> bool:
    """Eq. 10.7: disaggregate only when what it saves exceeds what it costs."""
    return terms.gain > terms.cost


def safe(terms: Terms) -> bool:
    """ember's guard beside eq. 10.7: the request's own first token must not come
    later than co-located (what its prefill gains on the prefill replica, ΔS, pays for
    all of the costs). Summed stall of the decoding streams buys less goodput than the
    same seconds of one request's TTFT: it spreads over their tokens."""
    return terms.specialization >= terms.cost


def transfer_seconds(kv_bytes: float, bandwidth_bps: float) -> float:
    """A lower bound on moving ``kv_bytes``: T_KV ≥ M_KV / B_eff."""
    return kv_bytes / bandwidth_bps


@dataclass
class ReplicaLoad:
    """What the decision needs of one replica: its decoding streams, its queued prompt
    tokens and its step cost model (all from the replica's routing stats)."""

    name: str
    decoding: int = 0  # streams past their prompt, each waiting on every step
    backlog_tokens: int = 0  # prompt tokens queued or being prefilled
    context: int = 0  # mean context of the decoding streams
    costs: StepCostModel = field(default_factory=lambda: StepCostModel(learn=False))
    budget: int = 512  # tokens per step (max_num_batched_tokens)
    step_limit: float = math.inf  # longest a step with prompt tokens may take

    @classmethod
    def of(cls, name: str, stats: Mapping[str, Any]) -> ReplicaLoad:
        load = stats.get("load", {})
        coef = load.get("costs")
        return cls(name, int(load.get("decoding", 0)), int(load.get("backlog_tokens", 0)),
                   int(load.get("context", 0)),
                   StepCostModel(Coefficients(**coef) if coef else None, learn=False),
                   int(load.get("budget", 512)), float(load.get("step_limit", math.inf)))

    def _decode_step(self) -> StepShape:
        n = self.decoding
        return StepShape(n, n, n * self.context, decode_rows=n, logits=n)

    def chunk(self, at: int) -> int:
        """Prompt tokens a step here carries beside the decoding streams, from position
        ``at``: the token budget's rest, cut to keep the step within its time limit (as
        the scheduler sizes chunks)."""
        base = self._decode_step()
        hi = max(MIN_CHUNK, self.budget - self.decoding)
        if self.step_limit == math.inf:
            return hi
        lo = MIN_CHUNK
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = self.costs.predict(base.plus(mid, at + mid, logits=1)) <= self.step_limit
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return lo

    def _steps(self, tokens: int, start: int) -> tuple[int, int, int]:
        """The steps computing ``tokens`` prompt tokens from ``start``: (full chunks,
        their size, the last chunk's size), chunks sized at the prompt's middle."""
        n = min(tokens, self.chunk(start + tokens // 2))
        full, rest = divmod(tokens, n)
        return full, n, rest

    def prefill_seconds(self, tokens: int, start: int = 0) -> float:
        """Seconds of steps that compute ``tokens`` prompt tokens from position ``start``
        beside the streams decoding here (a step's cost is linear in its context, so
        the full chunks cost as many times the one ending at their mean end)."""
        if tokens <= 0:
            return 0.0
        base = self._decode_step()
        full, n, rest = self._steps(tokens, start)
        mean_end = start + round(n * (full + 1) / 2)
        total = full * self.costs.predict(base.plus(n, mean_end, logits=1))
        if rest:
            total += self.costs.predict(base.plus(rest, start + tokens, logits=1))
        return total

    def stall(self, tokens: int, start: int = 0) -> float:
        """How much later each decoding stream here gets its tokens while ``tokens``
        prompt tokens are prefilled beside it: the prefill's steps minus the decode
        steps they replace."""
        if self.decoding == 0 or tokens <= 0:
            return 0.0
        full, _, rest = self._steps(tokens, start)
        return max(0.0, self.prefill_seconds(tokens, start)
                   - (full + bool(rest)) * self.costs.predict(self._decode_step()))

    def queue_seconds(self) -> float:
        """How long a prompt arriving now waits behind the prompt tokens queued here."""
        return self.prefill_seconds(self.backlog_tokens) if self.backlog_tokens else 0.0


@dataclass(frozen=True)
class Plan:
    """The decision for one request: prefill on ``prefill`` and decode on ``decode``
    (disaggregated), or everything on ``decode`` (``prefill`` is None)."""

    decode: str
    prefill: str | None
    terms: Terms | None  # of the best prefill candidate (None: there was none)
    kv_bytes: int = 0
    start: int = 0  # prompt tokens ``decode`` has cached: not computed nor handed over

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class Planner:
    """Chooses, per request, whether and where to prefill apart (thread-safe).

    ``prefill_replicas``: how many replicas may prefill for others (the first that many
    by name), or None for any of them ("auto"). A replica chosen for no prefill decodes
    like any other, so the prefill pool serves co-located requests whenever no handoff
    pays: the roles follow the traffic."""

    def __init__(self, prefill_replicas: int | None = None, policy: str = "rule") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.prefill_replicas = prefill_replicas
        self.policy = policy  # "always": every prompt with a block to hand over (static)
        self.bandwidth = BANDWIDTH_PRIOR
        self.coordination = COORDINATION_PRIOR
        self.handoffs = 0
        self.failures = 0
        self.decisions: Counter[str] = Counter()  # "disaggregated" / "colocated"
        # sums over disaggregated requests of what the decision predicted, and of what
        # was then measured (transfer and coordination are observed per handoff)
        self.predicted: Counter[str] = Counter()
        self.observed: Counter[str] = Counter()
        self.measured: Counter[str] = Counter()  # observations of bandwidth, coordination
        self.last: Terms | None = None
        self._lock = threading.Lock()

    @property
    def failure_rate(self) -> float:
        f, n = FAILURE_PRIOR
        return (self.failures + f) / (self.handoffs + n)

    def pool(self, replicas: Iterable[str]) -> list[str]:
        """The replicas that may prefill for others, among ``replicas``."""
        return sorted(replicas)[:self.prefill_replicas]

    def decoders(self, replicas: Iterable[str]) -> list[str]:
        """Where a request may decode: anywhere, but outside the prefill pool under
        static disaggregation (``always`` with a pool size), as static systems split."""
        names = sorted(replicas)
        if self.policy == "always" and self.prefill_replicas is not None:
            pool = set(self.pool(names))
            return [n for n in names if n not in pool] or names
        return names

    def terms(self, prefill: ReplicaLoad, decode: ReplicaLoad, tokens: int, start: int,
              kv_bytes: int) -> Terms:
        """Eq. 10.7's terms for prefilling ``tokens`` prompt tokens from ``start`` on
        ``prefill`` rather than on ``decode``."""
        transfer = transfer_seconds(kv_bytes, self.bandwidth)
        # loading the handed-over blocks stalls the decoder's streams too: the whole
        # measured transfer is counted as that stall (an upper bound)
        saved = (decode.decoding * max(0.0, decode.stall(tokens, start) - transfer)
                 - prefill.decoding * prefill.stall(tokens, start))
        imbalance = max(0.0, prefill.queue_seconds() - decode.queue_seconds())
        apart = prefill.prefill_seconds(tokens, start)
        sooner = max(0.0, decode.prefill_seconds(tokens, start) - apart)
        return Terms(saved, transfer, self.coordination, imbalance,
                     self.failure_rate * (apart + transfer), sooner)

    def plan(self, loads: Mapping[str, ReplicaLoad], decode: str, tokens: int, start: int,
             kv_bytes: int) -> Plan:
        """Where a request routed to ``decode`` prefills its ``tokens`` uncached prompt
        tokens (from position ``start``; ``kv_bytes`` to hand over): on the candidate
        whose terms leave the largest margin, if that margin is positive."""
        best: tuple[float, str, Terms] | None = None
        if tokens > 0 and decode in loads:
            for name in self.pool(loads):
                if name == decode:
                    continue
                load = loads[name]
                t = self.terms(load, loads[decode], tokens, start, kv_bytes)
                if best is None or t.gain - t.cost > best[0]:
                    best = (t.gain - t.cost, name, t)
        terms = best[2] if best else None
        pays = best is not None and (self.policy == "always"
                                     or (decide(best[2]) and safe(best[2])))
        chosen = best[1] if best and pays else None
        with self._lock:
            self.decisions["disaggregated" if chosen else "colocated"] += 1
            if terms is not None:
                self.last = terms
            if chosen and terms is not None:
                for name, value in terms.as_dict().items():
                    self.predicted[name] += value
        return Plan(decode, chosen, terms, kv_bytes if chosen else 0, start)

    def observe(self, *, ok: bool, kv_bytes: int = 0, transfer_s: float = 0.0,
                coordination_s: float | None = None) -> None:
        """A handoff ended: ``ok`` (its blocks were used) or failed; what it moved, in
        how long, and the extra hop's measured overhead."""
        with self._lock:
            self.handoffs += 1
            if not ok:
                self.failures += 1
            if ok and kv_bytes and transfer_s > 0:
                self.bandwidth += self._weight("bandwidth") * (kv_bytes / transfer_s
                                                               - self.bandwidth)
                self.observed["transfer"] += transfer_s
            if coordination_s is not None:
                c = max(0.0, coordination_s)
                self.coordination += self._weight("coordination") * (c - self.coordination)
                self.observed["coordination"] += c

    def _weight(self, name: str) -> float:
        """The newest observation's weight: the mean of the first ones (the prior is a
        guess: 1 GB/s where this machine's handoffs measure 70 MB/s, and an EWMA from it
        priced a dozen handoffs too cheap), then an EWMA that follows drift."""
        self.measured[name] += 1
        return max(EWMA, 1.0 / self.measured[name])

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            return {"decisions": dict(self.decisions), "handoffs": self.handoffs,
                    "failures": self.failures, "bandwidth_bps": self.bandwidth,
                    "coordination_s": self.coordination,
                    "predicted": {t: self.predicted.get(t, 0.0) for t in TERMS},
                    "observed": {t: self.observed.get(t, 0.0)
                                 for t in ("transfer", "coordination")},
                    "last": self.last.as_dict() if self.last else None}


def disagg_lines(m: Mapping[str, Any]) -> list[str]:
    """The planner's metrics (:meth:`Planner.metrics`) in the Prometheus text format."""
    decisions, ok = m["decisions"], m["handoffs"] - m["failures"]
    last = m["last"] or {}
    return [
        *family("ember_disagg_decisions_total", "counter",
                "Requests by the disaggregation rule's choice.",
                [(f'{{choice="{c}"}}', decisions.get(c, 0))
                 for c in ("disaggregated", "colocated")]),
        *family("ember_disagg_handoffs_total", "counter",
                "KV handoffs by outcome (failed: the decoding replica recomputed).",
                [('{result="ok"}', ok), ('{result="failed"}', m["failures"])]),
        *family("ember_disagg_bandwidth_bytes_per_second", "gauge",
                "Measured handoff bandwidth (export, transfer, checks and load).",
                [("", m["bandwidth_bps"])]),
        *family("ember_disagg_coordination_seconds", "gauge",
                "Measured overhead of the prefill hop beyond the prefill itself.",
                [("", m["coordination_s"])]),
        *family("ember_disagg_predicted_seconds_total", "counter",
                "Eq. 10.7 terms the rule predicted, summed over disaggregated requests.",
                [(f'{{term="{t}"}}', v) for t, v in m["predicted"].items()]),
        *family("ember_disagg_observed_seconds_total", "counter",
                "The same terms as measured after each handoff (transfer, coordination).",
                [(f'{{term="{t}"}}', v) for t, v in m["observed"].items()]),
        *family("ember_disagg_last_term_seconds", "gauge",
                "The terms of the latest decision with a prefill candidate.",
                [(f'{{term="{t}"}}', v) for t, v in last.items()]),
    ]
