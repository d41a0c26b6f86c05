"""``ember bench simulate``: a discrete-event model of an ember cluster.

What one machine cannot run — 8 or 32 replicas, a 100 Gbit/s link, a workload of
long documents — can be predicted from what it can measure: each replica is the
engine's scheduler in miniature, its steps priced by the step cost model
(:mod:`ember.engine.costs`, from an ``ember bench spec-cost`` table), and the
front routes and disaggregates with the same planner the server uses
(:mod:`ember.cluster.disagg`). Requests come from a measured ``ember bench serve``
run (its prompt, cached and output token counts, replayed at their send times or
re-timed at other rates) or from a fixed synthetic shape.

The replica model, per step: every decoding stream adds one token; the rest of the
token budget (``max_num_batched_tokens``) goes to prompts in arrival order, each
taking at most ``max_prefill_chunk`` tokens while another row is in the step (the
rest of the budget is handed out again); at most ``max_num_seqs`` requests are
admitted. A prompt's last chunk yields its first token at the end of that step. A
disaggregated request prefills on its prefill replica (prompt tokens only), then
waits the transfer (its KV bytes over the link) and the coordination delay, then
joins its decode replica with all but the last partial block cached. What is left
out: speculation, preemption (the KV pool is taken as large enough) and the prefix
cache's contents (a request's cached tokens are the trace's).
"""

from __future__ import annotations

import heapq
import json
import math
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.bench.goodput import Objectives, percentile
from ember.bench.traffic import arrivals
from ember.cluster.disagg import Planner, ReplicaLoad
from ember.engine.costs import Coefficients, StepCostModel, StepShape
from ember.engine.scheduler import MIN_PREFILL, STALL_MARGIN


@dataclass
class SimRequest:
    arrival: float
    prompt: int  # prompt tokens
    output: int  # tokens to generate
    cached: int = 0  # prompt tokens served from the prefix cache where it decodes
    kind: str = ""
    # filled in by the simulation
    done_prompt: int = 0  # prompt positions computed (cached ones count as done)
    produced: int = 0
    started: float | None = None  # its first chunk was scheduled
    first_token: float | None = None
    end: float | None = None
    replica: int = -1  # where it decodes
    prefill_on: int = -1  # where it prefilled, when disaggregated
    prompt_only: bool = False  # a disaggregated request's prefill part
    whole: SimRequest | None = None  # the request a prefill part was split from

    @property
    def status(self) -> str:
        """As a benchmark record's: ``ok`` once it ended (what Objectives.met reads)."""
        return "ok" if self.end is not None else "failed"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.end is None or self.output < 2:
            return None
        return (self.end - self.first_token) / (self.output - 1)


@dataclass
class Cluster:
    """What is simulated: replicas, their scheduler settings and step costs, the link."""

    replicas: int = 1
    costs: Coefficients = field(default_factory=Coefficients)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int | None = None  # default: a quarter of the token budget
    max_prefill_step_seconds: float = 0.5
    slo_tpot: float | None = None  # the engine's TPOT objective (ember serve --slo-tpot)
    prefill_replicas: int | str | None = None  # None: co-located; "auto" or a count
    policy: str = "rule"  # or "always" (static disaggregation)
    bandwidth_bps: float = 1e9  # KV handoff bandwidth, bytes/s
    coordination_s: float = 0.005  # the prefill hop's overhead
    kv_bytes_per_token: int = 0
    prefill_costs: Coefficients | None = None  # the prefill pool's own (other hardware)
    block_size: int = 16
    overhead_s: float = 0.0  # per request, before its first step (HTTP, template, hops)
    seed: int = 0

    @property
    def chunk(self) -> int:
        return self.max_prefill_chunk or max(1, self.max_num_batched_tokens // 4)


class _Replica:
    def __init__(self, index: int, cluster: Cluster, costs: Coefficients) -> None:
        self.index, self.c = index, cluster
        self.name = f"r{index:04d}"  # sorts as the index: the planner's pool is by name
        self.costs = StepCostModel(costs, learn=False)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # admitted: prefilling or decoding
        self.busy = False
        self.step_seconds = 0.0  # total time stepping (utilisation)

    def inflight(self) -> int:
        return len(self.waiting) + len(self.running)

    def step_limit(self, decoding: int) -> float:
        """How long a step with prompt tokens may take (the scheduler's rule)."""
        guard = STALL_MARGIN * self.c.slo_tpot if self.c.slo_tpot and decoding else math.inf
        return min(guard, self.c.max_prefill_step_seconds)

    def load(self) -> ReplicaLoad:
        decoding = [r for r in self.running if r.done_prompt >= r.prompt]
        backlog = sum(r.prompt - r.done_prompt for r in (*self.running, *self.waiting)
                      if r.done_prompt < r.prompt)
        context = sum(r.prompt + r.produced for r in decoding) // max(1, len(decoding))
        return ReplicaLoad(self.name, len(decoding), backlog, context, self.costs,
                           self.c.max_num_batched_tokens, self.step_limit(len(decoding)))

    def _fit(self, shape: StepShape, n: int, at: int, limit: float) -> int:
        """The most of ``n`` prompt tokens from ``at`` the step can take within ``limit``."""
        if limit == math.inf or self.costs.predict(shape.plus(n, at + n, logits=1)) <= limit:
            return n
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = self.costs.predict(shape.plus(mid, at + mid, logits=1)) <= limit
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return lo

    def plan_step(self) -> tuple[list[tuple[SimRequest, int]], float]:
        """The next step's rows (request, prompt tokens; 0 for a decode row) and its
        predicted seconds; admits waiting requests as the engine would."""
        while self.waiting and len(self.running) < self.c.max_num_seqs:
            self.running.append(self.waiting.popleft())
        rows: list[tuple[SimRequest, int]] = []
        shape = StepShape(0, 0, 0)
        for r in self.running:
            if r.done_prompt >= r.prompt:
                rows.append((r, 0))
                shape = shape.plus(1, r.prompt + r.produced)
        budget = self.c.max_num_batched_tokens - len(rows)
        limit = self.step_limit(len(rows))
        prefilling = [r for r in self.running if r.done_prompt < r.prompt]
        for r in prefilling:  # in arrival order, capped while others share the step
            if budget <= 0:
                break
            alone = len(rows) == 0 and len(prefilling) == 1
            n = min(budget, r.prompt - r.done_prompt, budget if alone else self.c.chunk)
            n = self._fit(shape, n, r.done_prompt, limit)
            if n == 0 and rows:
                break
            n = max(n, min(MIN_PREFILL, r.prompt - r.done_prompt))
            rows.append((r, n))
            shape = shape.plus(n, r.done_prompt + n, logits=1)
            budget -= n
        return rows, self.costs.predict(shape)


class Simulation:
    def __init__(self, cluster: Cluster, requests: Sequence[SimRequest],
                 slo: Objectives | None = None) -> None:
        self.c = cluster
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.slo = slo or Objectives()
        self.replicas = [_Replica(i, cluster, self._costs_of(i))
                         for i in range(cluster.replicas)]
        self.by_name = {x.name: x for x in self.replicas}
        self.rng = random.Random(cluster.seed)
        self.planner: Planner | None = None
        if cluster.prefill_replicas is not None and cluster.replicas > 1:
            k = cluster.prefill_replicas
            self.planner = Planner(None if k == "auto" else int(k), cluster.policy)
            self.planner.bandwidth = cluster.bandwidth_bps
            self.planner.coordination = cluster.coordination_s
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0

    def _costs_of(self, index: int) -> Coefficients:
        """Replica ``index``'s step costs: the prefill pool's own, if given."""
        k = self.c.prefill_replicas
        pool = (self.c.prefill_costs is not None and isinstance(k, int) and index < k)
        return self.c.prefill_costs if pool else self.c.costs  # type: ignore[return-value]

    # ------------------------------------------------------------ events
    def _at(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, payload))
        self._seq += 1

    def run(self) -> dict[str, Any]:
        for r in self.requests:
            self._at(r.arrival + self.c.overhead_s, "arrive", r)
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                self._route(payload)
            elif kind == "handed":
                self._enqueue(self.replicas[payload.replica], payload)
            else:
                self._end_step(*payload)
        return self.summary()

    def _enqueue(self, replica: _Replica, r: SimRequest) -> None:
        """Queue ``r`` by its arrival (a handed-over request keeps its place, as the
        engine orders its waiting requests by arrival)."""
        at = len(replica.waiting)
        while at and replica.waiting[at - 1].arrival > r.arrival:
            at -= 1
        replica.waiting.insert(at, r)
        if not replica.busy:
            self._start_step(replica)

    def _start_step(self, replica: _Replica) -> None:
        rows, seconds = replica.plan_step()
        if not rows:
            replica.busy = False
            return
        replica.busy = True
        for r, _ in rows:
            if r.started is None:
                r.started = self.now
        replica.step_seconds += seconds
        self._at(self.now + seconds, "step", (replica, rows))

    def _end_step(self, replica: _Replica, rows: list[tuple[SimRequest, int]]) -> None:
        for r, n in rows:
            if n == 0:
                r.produced += 1
            else:
                r.done_prompt += n
                if r.done_prompt < r.prompt:
                    continue
                if r.prompt_only:  # a handed-over prefill: its KV goes to the decoder
                    replica.running.remove(r)
                    self._hand_over(r)
                    continue
                r.produced += 1
            if r.produced == 1 and r.first_token is None:
                r.first_token = self.now
            if r.produced >= r.output:
                r.end = self.now
                replica.running.remove(r)
        self._start_step(replica)

    # ------------------------------------------------------------ routing
    def _route(self, r: SimRequest) -> None:
        """Power of two choices on in-flight requests (the affinity router's fallback;
        the trace's cached tokens stand for its prefix hits), then the planner."""
        candidates = self.replicas
        if self.planner is not None:
            names = set(self.planner.decoders(x.name for x in self.replicas))
            candidates = [x for x in self.replicas if x.name in names]
        pair = self.rng.sample(candidates, min(2, len(candidates)))
        decode = min(pair, key=lambda x: (x.inflight(), x.index))
        r.replica = decode.index
        r.done_prompt = min(r.cached, r.prompt - 1)
        if self.planner is not None:
            bs = self.c.block_size
            handed = (r.prompt - 1) // bs * bs
            tokens = handed - r.done_prompt
            loads = {x.name: x.load() for x in self.replicas}
            plan = self.planner.plan(loads, decode.name, tokens, r.done_prompt,
                                     tokens * self.c.kv_bytes_per_token)
            if plan.prefill is not None:
                self._prefill_apart(r, self.by_name[plan.prefill], handed)
                return
        self._enqueue(decode, r)

    def _prefill_apart(self, r: SimRequest, prefill: _Replica, handed: int) -> None:
        part = SimRequest(r.arrival, handed, 0, kind=r.kind, prompt_only=True,
                          done_prompt=r.done_prompt, whole=r)
        part.replica, part.prefill_on = r.replica, prefill.index
        r.prefill_on = prefill.index
        self._enqueue(prefill, part)

    def _hand_over(self, part: SimRequest) -> None:
        r = part.whole
        assert r is not None
        # only the blocks the decoder lacked travel; it computes the tail and samples
        moved = part.prompt - r.done_prompt
        r.done_prompt = part.prompt
        r.started = part.started
        delay = self.c.coordination_s + moved * self.c.kv_bytes_per_token / self.c.bandwidth_bps
        self._at(self.now + delay, "handed", r)

    # ------------------------------------------------------------ results
    def summary(self) -> dict[str, Any]:
        reqs = self.requests
        done = [r for r in reqs if r.end is not None]
        good = [r for r in done if self.slo.met(r)]  # type: ignore[arg-type]
        start = min((r.arrival for r in reqs), default=0.0)
        duration = max((r.end for r in done), default=start) - start
        ttft = [r.ttft for r in done if r.ttft is not None]
        tpot = [r.tpot for r in done if r.tpot is not None]
        out = {"replicas": self.c.replicas, "requests": len(reqs), "completed": len(done),
               "good": len(good), "duration_s": duration,
               "goodput_rps": len(good) / duration if duration > 0 else 0.0,
               "throughput_rps": len(done) / duration if duration > 0 else 0.0,
               "output_tps": sum(r.output for r in done) / duration if duration > 0 else 0.0,
               "attainment": len(good) / len(reqs) if reqs else 0.0,
               "ttft_s": {"median": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
               "tpot_s": {"median": percentile(tpot, 0.5), "p99": percentile(tpot, 0.99)},
               "utilisation": [round(x.step_seconds / duration, 3) if duration else 0.0
                               for x in self.replicas],
               "disaggregated": sum(1 for r in reqs if r.prefill_on >= 0)}
        if self.planner is not None:
            out["decisions"] = dict(self.planner.decisions)
        return out


# ---------------------------------------------------------------- inputs
def requests_of_trace(path: Path, step: int | None = None) -> list[list[SimRequest]]:
    """Each step of an ``ember bench serve`` result (or only step ``step``) as the
    requests it sent: send time, prompt, cached and output tokens of each completed
    one (a request the server refused or failed has no counts to replay)."""
    steps = json.loads(Path(path).read_text())["steps"]
    chosen = steps if step is None else [steps[step]]
    out = []
    for s in chosen:
        recs = [r for r in s["records"] if r["status"] == "ok" and r["prompt_tokens"]]
        out.append([SimRequest(r["sent"], r["prompt_tokens"], max(1, r["output_tokens"]),
                               r["cached_tokens"], r["kind"]) for r in recs])
    return out


def retimed(requests: Sequence[SimRequest], rate: float, count: int | None = None,
            seed: int = 0) -> list[SimRequest]:
    """The same mix of requests (drawn in turn, cycling), arriving as a Poisson process
    at ``rate`` per second."""
    n = count or len(requests)
    times = arrivals(rate, n, seed=seed)
    return [SimRequest(t, r.prompt, r.output, r.cached, r.kind)
            for t, r in zip(times, (requests[i % len(requests)] for i in range(n)),
                            strict=True)]


def synthetic(rate: float, count: int, prompt: int, output: int, cached: int = 0,
              seed: int = 0) -> list[SimRequest]:
    return [SimRequest(t, prompt, output, cached, "synthetic")
            for t in arrivals(rate, count, seed=seed)]


def read_costs(path: Path) -> Coefficients:
    """The coefficients of an ``ember bench spec-cost`` table (or a bare dict of them)."""
    data = json.loads(Path(path).read_text())
    return Coefficients(**data.get("coefficients", data))


def md1_wait(rate: float, service: float) -> float:
    """The mean wait in queue of an M/D/1 queue (Pollaczek–Khinchine)."""
    rho = rate * service
    if rho >= 1:
        return math.inf
    return rho * service / (2 * (1 - rho))


# ---------------------------------------------------------------- the command
def kv_bytes_per_token(model: str, kv_dtype: str = "f16") -> int:
    """K and V of one token, every layer, in ``kv_dtype`` (what a handoff moves)."""
    from ember.kv.blocks import KVStorage
    from ember.models.loader import load_model_meta

    cfg = load_model_meta(model, "f32").config
    return KVStorage.bytes_per_block_of(cfg.n_layers, 1, cfg.n_kv_heads, cfg.head_dim,
                                        kv_dtype)


@dataclass
class Point:
    """One simulated configuration and load."""

    replicas: int
    prefill: str  # "off", "auto" or a count
    bandwidth_gbit: float
    rate: float | None  # None: a trace step replayed at its own times
    requests: list[SimRequest]
    measured: dict[str, Any] | None = None  # the trace step's own summary


def _prefill_option(text: str) -> int | str | None:
    return None if text == "off" else text if text == "auto" else int(text)


def run_points(points: Sequence[Point], base: Cluster, slo: Objectives) -> list[dict[str, Any]]:
    rows = []
    print(_HEADER, flush=True)
    for p in points:
        c = Cluster(**{**base.__dict__, "replicas": p.replicas,
                       "prefill_replicas": _prefill_option(p.prefill),
                       "bandwidth_bps": p.bandwidth_gbit * 1e9 / 8})
        fresh = [SimRequest(r.arrival, r.prompt, r.output, r.cached, r.kind)
                 for r in p.requests]
        got = Simulation(c, fresh, slo).run()
        row = {"replicas": p.replicas, "prefill_replicas": p.prefill,
               "bandwidth_gbit": p.bandwidth_gbit, "rate": p.rate,
               "mean_prompt": statistics.fmean(r.prompt for r in p.requests)
               if p.requests else 0.0, **got}
        if p.measured is not None:
            measured = p.measured["goodput_rps"]
            row["measured_goodput_rps"] = measured
            row["error"] = (got["goodput_rps"] - measured) / measured if measured else None
        rows.append(row)
        print(_format(row), flush=True)
    return rows


_HEADER = (f"{'replicas':>8} {'prefill':>7} {'Gbit/s':>6} {'rate':>6} {'prompt':>6} {'sent':>5} "
           f"{'goodput':>8} {'measured':>8} {'error':>6} {'ttft p50':>9} {'ttft p99':>9} "
           f"{'tpot p50':>9} {'tpot p99':>9} {'split':>5}")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}ms"


def _format(row: dict[str, Any]) -> str:
    rate = "trace" if row["rate"] is None else f"{row['rate']:g}"
    measured = row.get("measured_goodput_rps")
    error = row.get("error")
    return (f"{row['replicas']:>8} {row['prefill_replicas']:>7} {row['bandwidth_gbit']:>6g} "
            f"{rate:>6} {row['mean_prompt']:>6.0f} {row['requests']:>5} "
            f"{row['goodput_rps']:>8.3f} "
            f"{'-' if measured is None else f'{measured:.3f}':>8} "
            f"{'-' if error is None else f'{error:+.0%}':>6} "
            f"{_ms(row['ttft_s']['median']):>9} {_ms(row['ttft_s']['p99']):>9} "
            f"{_ms(row['tpot_s']['median']):>9} {_ms(row['tpot_s']['p99']):>9} "
            f"{row['disaggregated']:>5}")


def main(*, costs: Path, trace: Path | None, prompt_tokens: list[int],
         output_tokens: int, cached_tokens: int, rates: list[float], requests: int,
         replicas: list[int], prefill: list[str], bandwidths: list[float],
         base: Cluster, slo: Objectives, out: Path) -> list[dict[str, Any]]:
    """Simulate every combination of ``replicas`` × ``prefill`` × ``bandwidths`` ×
    ``rates`` (or, with a trace and no rates, each of the trace's steps as sent; without
    a trace, × each synthetic prompt length)."""
    base = Cluster(**{**base.__dict__, "costs": read_costs(costs)})
    mixes: list[tuple[float | None, list[SimRequest], dict[str, Any] | None]] = []
    if trace is not None:
        steps = json.loads(Path(trace).read_text())["steps"]
        replayed = requests_of_trace(trace)
        if rates:
            pool = [r for step in replayed for r in step]
            mixes = [(rate, retimed(pool, rate, requests, base.seed), None) for rate in rates]
        else:
            mixes = [(None, reqs, step) for reqs, step in zip(replayed, steps, strict=True)]
    else:
        if not prompt_tokens or not rates:
            raise ValueError("give --trace, or --prompt-tokens and --rates")
        mixes = [(rate, synthetic(rate, requests, n, output_tokens, cached_tokens,
                                  base.seed), None) for n in prompt_tokens for rate in rates]
    points = [Point(n, p, bw, rate, reqs, measured)
              for n in replicas for p in prefill for bw in bandwidths
              for rate, reqs, measured in mixes]
    rows = run_points(points, base, slo)
    out.parent.mkdir(parents=True, exist_ok=True)
    pool = base.prefill_costs.__dict__ if base.prefill_costs else None
    out.write_text(json.dumps({"cluster": {k: v for k, v in base.__dict__.items()
                                           if k not in ("costs", "prefill_costs")},
                               "costs": base.costs.__dict__, "prefill_costs": pool,
                               "slo": slo.__dict__,
                               "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return rows
