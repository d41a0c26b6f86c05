"""Tenant-aware prefix-affinity routing of request groups to ember replicas.

A request's routing key is the chain of prefix-cache keys of its prompt's full
blocks, computed under its tenant's salt exactly as the replicas' prefix caches
compute them (:func:`ember.kv.prefix.extend_keys`). Two tenants sending the same text
have disjoint keys, so tenant B is never routed by tenant A's cache: B could not hit
it (the text-matching routers of SGLang and Ray Serve LLM would send B there anyway).

What the router believes a replica holds (:class:`RoutingView`) is the union of

- the replica's own digest: the keys in its prefix cache, reported through Ray
  Serve's routing stats (``record_routing_stats``, every ``stats_period`` seconds);
- the keys of requests routed to it since (their blocks are being computed there).

A stale view costs a cache miss, never a wrong answer: the replica looks its prefix
cache up itself, and a hit is verified token by token there.

Policy (:func:`choose`): the candidate with the longest cached prefix wins if that
prefix is at least ``min_match`` of the prompt's blocks and its in-flight streams do
not exceed the least loaded replica's by more than ``imbalance``. Otherwise power of
two choices on in-flight streams (ties to the longer match): a short match — the
system prompt every conversation of a tenant shares — must not pin all of a tenant's
new conversations to one replica (measured: it did, and follow-up TTFT suffered on
the overloaded replica).
"""

from __future__ import annotations

import importlib
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ROUTED_KEYS = 1 << 16  # keys remembered per replica from routing (the digest has the rest)
ROUTED_TTL = 60.0  # seconds a routed key counts without the replica's digest confirming it
MIN_MATCH = 0.5  # share of a prompt's blocks a replica must hold to win it by affinity


@dataclass
class Decision:
    replica: str
    by: str  # "affinity" or "load"
    blocks: int  # cached blocks predicted on that replica


@dataclass
class RoutingView:
    """Process-wide: the router(s) and the front of one process share it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: Counter = field(default_factory=Counter)  # replica -> open streams (this front)
    placed: dict[str, str] = field(default_factory=dict)  # request id -> replica routed to
    digests: dict[str, frozenset[bytes]] = field(default_factory=dict)
    routed: dict[str, OrderedDict[bytes, float]] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica -> routing stats
    decisions: Counter = field(default_factory=Counter)  # "affinity" / "load" -> requests
    predicted_blocks: dict[str, int] = field(default_factory=dict)  # request id -> blocks
    predicted_tokens: int = 0
    actual_tokens: int = 0  # cached prompt tokens the replicas reported for routed requests
    retries: int = 0  # groups re-dispatched after their replica died before streaming
    replica_failures: int = 0  # streams cut by a replica's death

    def load(self, replica: str) -> int:
        return self.inflight.get(replica, 0)

    def place(self, request_id: str, replica: str) -> None:
        """A request was routed to ``replica``: it counts there from now (not from the
        replica's answer, so a burst being routed already weighs on the imbalance)."""
        with self.lock:
            self.inflight[replica] += 1
            self.placed[request_id] = replica

    def unplace(self, request_id: str) -> None:
        """The request's stream on its replica ended (or never started)."""
        with self.lock:
            replica = self.placed.pop(request_id, None)
            if replica is not None:
                self.inflight[replica] -= 1

    def match(self, replica: str, keys: Sequence[bytes], now: float) -> int:
        """Leading blocks of ``keys`` the replica is believed to hold."""
        digest = self.digests.get(replica, frozenset())
        routed = self.routed.get(replica, {})
        n = 0
        for key in keys:
            if key in digest or routed.get(key, 0.0) > now - ROUTED_TTL:
                n += 1
            else:
                break
        return n

    def observe(self, replica: str, stats: dict[str, Any] | None) -> None:
        """Take a replica's routing stats (its digest and engine metrics)."""
        if not stats or stats is self.stats.get(replica):
            return
        with self.lock:
            self.stats[replica] = stats
            self.digests[replica] = frozenset(stats.get("keys", ()))

    def routed_to(self, replica: str, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        with self.lock:
            seen = self.routed.setdefault(replica, OrderedDict())
            for key in keys:
                seen[key] = now
                seen.move_to_end(key)
            while len(seen) > ROUTED_KEYS:
                seen.popitem(last=False)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each replica's latest routing stats (a consistent copy)."""
        with self.lock:
            return dict(self.stats)

    def observe_replicas(self, replicas: Sequence[Any]) -> dict[str, Any]:
        """Take the routing stats of Ray Serve's ``replicas``; return them by id."""
        by_id = {r.replica_id.unique_id: r for r in replicas}
        for rid, r in by_id.items():
            self.observe(rid, r.routing_stats)
        return by_id

    def prune(self, replicas: Sequence[Any]) -> None:
        """Take the live replicas' stats; forget the ones no longer among them."""
        live = self.observe_replicas(replicas)
        for gone in set(self.snapshot()) - set(live):
            self.forget(gone)

    def record_routed(self, request_id: str, keys: Sequence[bytes], replica: str, by: str,
                      blocks: int) -> None:
        """A request went to ``replica`` (decided ``by``, ``blocks`` predicted cached)."""
        self.routed_to(replica, keys)
        self.place(request_id, replica)
        with self.lock:
            self.decisions[by] += 1
            self.predicted_blocks[request_id] = blocks

    def forget(self, replica: str) -> None:
        with self.lock:
            for table in (self.digests, self.routed, self.stats):
                table.pop(replica, None)

    def reset(self) -> None:
        """Forget everything (a new deployment in this process)."""
        with self.lock:
            for table in (self.inflight, self.placed, self.digests, self.routed, self.stats,
                          self.decisions, self.predicted_blocks):
                table.clear()
            self.predicted_tokens = self.actual_tokens = 0
            self.retries = self.replica_failures = 0


VIEW = RoutingView()


def view() -> RoutingView:
    """The process's view, looked up through the module: Ray may deserialize the router
    class by value, with its own copy of this module's globals."""
    return importlib.import_module("ember.cluster.router").VIEW


def choose(keys: Sequence[bytes], candidates: Sequence[str], v: RoutingView,
           imbalance: int, min_match: float = MIN_MATCH,
           rng: random.Random | None = None) -> Decision:
    """Where a request with prefix ``keys`` goes among ``candidates`` (see the module)."""
    now = time.monotonic()
    loads = {c: v.load(c) for c in candidates}
    least = min(loads.values())
    matches = {c: v.match(c, keys, now) for c in candidates}
    best = max(candidates, key=lambda c: (matches[c], -loads[c]))
    if (matches[best] > 0 and matches[best] >= min_match * len(keys)
            and loads[best] - least <= imbalance):
        return Decision(best, "affinity", matches[best])
    pair = (rng or random).sample(list(candidates), min(2, len(candidates)))
    pick = min(pair, key=lambda c: (loads[c], -matches[c]))
    return Decision(pick, "load", matches[pick])


def eligible(spec: Any, candidates: list[str]) -> list[str]:
    """The candidates the spec has not been refused by (all of them if it was by all)."""
    avoid = set(spec.avoid) if spec is not None else set()
    return [c for c in candidates if c not in avoid] or candidates


def _pinned(pending: Any, by_id: dict[str, Any]) -> list[list] | None:
    """The ranking for a request meant for one named replica: a purge goes there or
    nowhere (none while it is not among the candidates); a group the front placed (a
    disaggregated one's prefill or decode) there first, then the others it has not been
    refused by. None for any other request."""
    from ember.cluster.protocol import GroupSpec, PurgeSpec
    from ember.cluster.wire import peek

    for arg in pending.args[:1] if pending is not None else ():
        arg = peek(arg) if isinstance(arg, bytes) else None
        if isinstance(arg, PurgeSpec):
            return [[by_id[arg.replica]]] if arg.replica in by_id else []
        if isinstance(arg, GroupSpec) and arg.replica in by_id and arg.replica not in arg.avoid:
            rest = [r for r in eligible(arg, sorted(by_id)) if r != arg.replica]
            return [[by_id[arg.replica]], [by_id[r] for r in rest]]
    return None


def _placed_by(spec: Any, by: str) -> str:
    """What decided a group's replica, for the router's counters."""
    if spec.prefill:
        return "prefill"
    return "disaggregated" if spec.handoff is not None else by


def _spec_of(pending: Any) -> Any:
    from ember.cluster.protocol import GroupSpec
    from ember.cluster.wire import peek

    if pending is None or not pending.args or not isinstance(pending.args[0], bytes):
        return None
    spec = peek(pending.args[0])
    return spec if isinstance(spec, GroupSpec) else None


try:  # Ray is optional: the policy above is usable (and tested) without it
    from ray.serve.request_router import RequestRouter
except ImportError:  # pragma: no cover - exercised where ray is not installed
    RequestRouter = object  # type: ignore[assignment,misc]


class _ViewUpkeep(RequestRouter):  # type: ignore[misc,valid-type]
    """Keeps the process's view of the replicas in step with Ray Serve's."""

    def update_replicas(self, replicas: list) -> None:
        super().update_replicas(replicas)
        view().prune(replicas)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        view().forget(replica_id.unique_id)


class PrefixAffinityRouter(_ViewUpkeep):
    """Ray Serve request router for :class:`ember.cluster.replica.EmberReplica`."""

    def initialize_state(self, imbalance: int = 4, min_match: float = MIN_MATCH,
                         **_: Any) -> None:
        self._imbalance = imbalance
        self._min_match = min_match
        # decisions awaiting on_request_routed, by request id (bounded: a routing that is
        # cancelled never gets there)
        self._pending: OrderedDict[str, Decision] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None
                              ) -> list[list]:
        v = view()
        by_id = v.observe_replicas(candidate_replicas)
        pinned = _pinned(pending_request, by_id)
        if pinned is not None:
            return pinned
        if not by_id:
            return []
        spec = _spec_of(pending_request)
        ranked = sorted(by_id, key=v.load)
        if spec is None:  # not a generation (or no key): least loaded first
            return [[by_id[r] for r in ranked]]
        decision = choose(spec.keys, eligible(spec, list(by_id)), v, self._imbalance,
                          self._min_match)
        self._pending[spec.request_id] = decision
        while len(self._pending) > 4096:
            self._pending.popitem(last=False)
        return [[by_id[decision.replica]], [by_id[r] for r in ranked if r != decision.replica]]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        spec = _spec_of(pending_request)
        if spec is None:
            return
        decision = self._pending.pop(spec.request_id, None)
        v = view()
        replica = replica_id.unique_id
        if decision is None or decision.replica != replica:  # fell through to another rank
            decision = Decision(replica, "load", v.match(replica, spec.keys, time.monotonic()))
        v.record_routed(spec.request_id, spec.keys, replica, _placed_by(spec, decision.by),
                        decision.blocks)


class RoundRobinRouter(_ViewUpkeep):
    """Replicas in turn, blind to caches and load: the baseline ``ember bench serve``
    measures the prefix-affinity router against (``ember serve --router round-robin``)."""

    def initialize_state(self, **_: Any) -> None:
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None
                              ) -> list[list]:
        by_id = view().observe_replicas(candidate_replicas)
        pinned = _pinned(pending_request, by_id)
        if pinned is not None:
            return pinned
        spec = _spec_of(pending_request)
        ranked = [by_id[r] for r in sorted(eligible(spec, list(by_id)))]
        if not ranked:
            return []
        first = self._turn % len(ranked)
        if spec is not None:
            self._turn += 1
        return [[ranked[first]], ranked[first + 1:] + ranked[:first]]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        spec = _spec_of(pending_request)
        if spec is None:
            return
        v, replica = view(), replica_id.unique_id
        v.record_routed(spec.request_id, spec.keys, replica, _placed_by(spec, "round-robin"),
                        v.match(replica, spec.keys, time.monotonic()))


ROUTERS = {"affinity": "ember.cluster.router:PrefixAffinityRouter",
           "round-robin": "ember.cluster.router:RoundRobinRouter"}
