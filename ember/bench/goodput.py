"""Goodput and latency statistics of a benchmark run.

Goodput (DistServe's definition) is the number of requests that completed and met
every objective — time to first token and time per output token — divided by the
run's duration, from its start to the end of its last request. A refused (429),
failed or timed-out request never counts as good, so shedding load only helps
goodput when what is shed would have missed anyway.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from ember.bench.loadgen import RequestRecord, RunResult


@dataclass(frozen=True)
class Objectives:
    ttft: float | None = None  # seconds
    tpot: float | None = None  # seconds

    @classmethod
    def parse(cls, text: str | None) -> Objectives:
        """``ttft=2000,tpot=150`` (milliseconds), as ``vllm bench serve --goodput``."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for part in text.split(","):
            name, _, ms = part.partition("=")
            name = name.strip()
            if name not in ("ttft", "tpot"):
                raise ValueError(f"--slo: unknown objective {name!r} (ttft, tpot)")
            try:
                values[name] = float(ms) / 1000
            except ValueError:
                raise ValueError(f"--slo: {name} needs milliseconds, got {ms!r}") from None
            if not values[name] > 0:
                raise ValueError(f"--slo: {name} must be positive, got {ms!r}")
        return cls(**values)

    def met(self, r: RequestRecord) -> bool:
        if r.status != "ok" or r.ttft is None:
            return False
        if self.ttft is not None and r.ttft > self.ttft:
            return False
        return self.tpot is None or r.tpot is None or r.tpot <= self.tpot


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(values) if values else None,
            "median": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def summarize(result: RunResult, slo: Objectives) -> dict[str, Any]:
    recs = result.records
    ok = [r for r in recs if r.status == "ok"]
    good = [r for r in recs if slo.met(r)]
    span = max((r.scheduled for r in recs), default=0.0)
    duration = result.duration
    per_tenant: dict[int, dict[str, Any]] = {}
    for tenant in sorted({r.tenant for r in recs}):
        mine = [r for r in recs if r.tenant == tenant]
        mine_good = sum(1 for r in mine if slo.met(r))
        per_tenant[tenant] = {
            "sent": len(mine), "good": mine_good,
            "attainment": mine_good / len(mine),
            "ttft": _dist([r.ttft for r in mine if r.status == "ok" and r.ttft is not None]),
        }
    return {
        "sent": len(recs), "planned": result.planned, "completed": len(ok),
        "rejected": sum(1 for r in recs if r.status == "rejected"),
        "failed": sum(1 for r in recs if r.status in ("failed", "timeout")),
        "good": len(good),
        "rejected_with_retry_after": sum(1 for r in recs if r.status == "rejected"
                                         and r.retry_after is not None),
        "duration_s": duration,
        "offered_rps": (len(recs) - 1) / span if span > 0 and len(recs) > 1 else None,
        "throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "goodput_rps": len(good) / duration if duration > 0 else 0.0,
        "output_tps": sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0,
        "attainment": len(good) / len(recs) if recs else 0.0,
        "ttft_s": _dist([r.ttft for r in ok if r.ttft is not None]),
        # follow-up turns resend their conversation: where a prefix cache (and a router
        # that finds it) pays
        "ttft_follow_up_s": _dist([r.ttft for r in ok if r.ttft is not None and r.turn > 0]),
        "prefix_hit_rate": (sum(r.cached_tokens for r in ok)
                            / max(1, sum(r.prompt_tokens for r in ok))),
        "tpot_s": _dist([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _dist([x for r in ok for x in r.itls]),
        "e2e_s": _dist([r.e2e for r in ok if r.e2e is not None]),
        "saturated": result.saturated,
        "per_tenant": per_tenant,
    }
