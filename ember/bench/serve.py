"""``ember bench serve``: goodput of any OpenAI-compatible endpoint under load.

    ember bench serve --url http://127.0.0.1:8000 --rates 0.5,1,2,4 --slo ttft=2000,tpot=150
    ember bench serve --url URL_A --compare URL_B --rates 1,2,4 --api-keys k1,k2,k3,k4

Every step sends one arrival trace (Poisson or gamma at a rate, or N closed-loop
clients) and prints a row: what was sent and how it ended, request throughput,
goodput, output tokens per second, TTFT / TPOT percentiles and SLO attainment. With
``--compare`` both endpoints get the same trace in each step, alternately (A then B,
then B then A), after the same warm-up. Results go to a JSON file and, with
matplotlib installed, to PNG plots.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ember.bench.goodput import Objectives, summarize
from ember.bench.loadgen import Endpoint, run
from ember.bench.traffic import Workload, arrivals


@dataclass
class Plan:
    rates: list[float]  # empty: closed loop with ``concurrency`` clients
    concurrency: int | None
    duration: float
    num_requests: int | None
    burstiness: float
    workload: str
    tenants: int
    seed: int
    timeout: float
    warmup: int


SETTLE_LIMIT_S = 900.0  # longest wait for an endpoint to finish what a step left it


def main(endpoints: list[Endpoint], plan: Plan, slo: Objectives, out: Path,
         plot: Path | None) -> list[dict[str, Any]]:
    idle = {}
    for ep in endpoints:
        ep.model = ep.model or _served_model(ep)
        _warm_up(ep, plan)
        took = [t for t in (_probe(ep, plan.timeout) for _ in range(3)) if t is not None]
        idle[ep.label] = min(took) if took else None
        if not took:
            print(f"{ep.label}: a one-token request got no answer: steps follow each other "
                  "without waiting for it to settle", flush=True)
    rows = []
    steps = plan.rates or [None]
    for i, rate in enumerate(steps):
        order = endpoints if i % 2 == 0 else endpoints[::-1]
        for ep in order:
            rows.append(_step(ep, plan, rate, slo, plan.seed + i))
            rows[-1]["settle_s"] = _settle(ep, idle[ep.label], plan.timeout)
            print(_format(rows[-1]), flush=True)
    rows.sort(key=lambda r: (endpoints.index(next(e for e in endpoints
                                                  if e.label == r["endpoint"])),
                             r["rate"] or 0))
    print()
    print(_table(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plan": plan.__dict__, "slo": slo.__dict__,
                               "endpoints": [{"label": e.label, "url": e.url,
                                              "model": e.model} for e in endpoints],
                               "steps": rows}, indent=2))
    print(f"\nwrote {out}")
    if plot is not None:
        from ember.bench.plots import plot_steps

        for path in plot_steps(rows, slo, plot):
            print(f"wrote {path}")
    return rows


def _served_model(ep: Endpoint) -> str:
    headers = ep.headers(0)
    r = httpx.get(f"{ep.url}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _warm_up(ep: Endpoint, plan: Plan) -> None:
    if plan.warmup <= 0:
        return
    workload = Workload(plan.workload, plan.tenants, seed=plan.seed + 10_000)
    asyncio.run(run(ep, workload, concurrency=1, num_requests=plan.warmup,
                    timeout=plan.timeout))


def _probe(ep: Endpoint, timeout: float) -> float | None:
    """Seconds a one-token chat request takes now (None: refused or failed)."""
    body = {"model": ep.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Say hi."}]}
    start = time.monotonic()
    try:
        r = httpx.post(f"{ep.url}/v1/chat/completions", json=body, headers=ep.headers(0),
                       timeout=timeout)
    except httpx.HTTPError:
        return None
    return time.monotonic() - start if r.status_code == 200 else None


def _settle(ep: Endpoint, idle: float | None, timeout: float) -> float:
    """Wait until ``ep`` answers a one-token request about as fast as when it was idle
    (twice that, or 0.1 s more); the seconds waited. A step cut short, or requests the
    client gave up on, can leave a server working on for minutes (llama-server computes
    a queued request whose client has gone until it has a token to write), and on the
    same cores that work would run into the next step, of either endpoint. No wait when
    the endpoint never answered the probe idle (``idle`` None)."""
    start = time.monotonic()
    if idle is None:
        return 0.0
    while time.monotonic() - start < SETTLE_LIMIT_S:
        took = _probe(ep, timeout)
        if took is not None and took <= max(2 * idle, idle + 0.1):
            break
        time.sleep(0.5)
    return round(time.monotonic() - start, 1)


def _step(ep: Endpoint, plan: Plan, rate: float | None, slo: Objectives,
          seed: int) -> dict[str, Any]:
    # each step its own seed: the last step's prompts would be prefix-cache hits in this one
    workload = Workload(plan.workload, plan.tenants, seed=seed)
    started = time.time()
    if rate is None:
        n = plan.num_requests or 100
        result = asyncio.run(run(ep, workload, concurrency=plan.concurrency, num_requests=n,
                                 timeout=plan.timeout))
    else:
        n = plan.num_requests or max(10, round(rate * plan.duration))
        times = arrivals(rate, n, plan.burstiness, seed=seed)
        result = asyncio.run(run(ep, workload, times, timeout=plan.timeout,
                                 slo_ttft=slo.ttft))
    return {"endpoint": ep.label, "rate": rate, "concurrency": plan.concurrency,
            "started": started, **summarize(result, slo),
            "records": [r.as_dict() for r in result.records]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


_HEADER = (f"{'endpoint':<12} {'load':>7} {'sent':>5} {'ok':>5} {'429':>4} {'fail':>4} "
           f"{'good':>5} {'req/s':>6} {'goodput':>7} {'tok/s':>7} {'TTFT p50':>8} "
           f"{'p99':>7} {'TPOT p50':>8} {'p99':>6} {'attain':>6} {'hit%':>5} "
           f"{'TTFT fu p50':>11}")


def _format(row: dict[str, Any]) -> str:
    load = f"{row['rate']:g}/s" if row["rate"] is not None else f"c={row['concurrency']}"
    flag = "  (over-saturated: stopped early)" if row["saturated"] else ""
    if row.get("settle_s", 0) > 2:
        flag += f"  (busy {row['settle_s']:g} s after the step: waited)"
    return (f"{row['endpoint']:<12} {load:>7} {row['sent']:>5} {row['completed']:>5} "
            f"{row['rejected']:>4} {row['failed']:>4} {row['good']:>5} "
            f"{row['throughput_rps']:>6.2f} {row['goodput_rps']:>7.2f} "
            f"{row['output_tps']:>7.1f} {_ms(row['ttft_s']['median']):>8} "
            f"{_ms(row['ttft_s']['p99']):>7} {_ms(row['tpot_s']['median']):>8} "
            f"{_ms(row['tpot_s']['p99']):>6} {row['attainment']:>6.0%} "
            f"{row['prefix_hit_rate']:>5.0%} {_ms(row['ttft_follow_up_s']['median']):>11}"
            f"{flag}")


def _table(rows: list[dict[str, Any]]) -> str:
    return "\n".join([_HEADER, *(_format(r) for r in rows)])
