"""The engine's counters as one plain dict (the server formats it for Prometheus)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ember.engine.commit import Commit
from ember.engine.scheduler import Scheduler
from ember.kv.manager import KVCacheManager
from ember.kv.prefix import tenant_name
from ember.models.moe import ExpertStore
from ember.spec.speculator import SpecStats


class SpecTotals:
    """What speculation did over finished requests: drafted and accepted tokens per
    source, bonus tokens, and steps that verified, fell back or were gated off."""

    def __init__(self) -> None:
        self.sources: dict[str, list[int]] = {}
        self.bonus = 0
        self.steps = {"verify": 0, "fallback": 0, "off": 0}

    def add(self, s: SpecStats) -> None:
        for name, (drafted, accepted) in s.by_source.items():
            source = self.sources.setdefault(name, [0, 0])
            source[0] += drafted
            source[1] += accepted
        self.bonus += s.bonus
        for kind in self.steps:
            self.steps[kind] += getattr(s, f"{kind}_steps")

    def as_dict(self) -> dict[str, Any]:
        return {"sources": self.sources, "bonus": self.bonus, "steps": self.steps}


def moe_metrics(experts: ExpertStore | None) -> dict[str, Any] | None:
    """The expert store's counters (a mixture-of-experts model only)."""
    if experts is None:
        return None
    return {**experts.stats.as_dict(), "streamed": experts.streamed,
            "cached_bytes": experts.cached_bytes}


# what tenant_counts reports of each tenant (the engine adds its resident adapters)
TENANT_COUNTS = ("requests_running", "requests_waiting", "kv_blocks", "cached_blocks",
                 "disk_bytes", "adapters")


def tenant_counts(scheduler: Scheduler, kv: KVCacheManager) -> dict[str, dict[str, int]]:
    """Per tenant: running and waiting requests, the KV blocks its running requests hold,
    its cached prefix blocks and its disk-tier bytes (safe to call from any thread)."""
    counts: dict[str, dict[str, int]] = {}

    def of(tenant: str) -> dict[str, int]:
        return counts.setdefault(tenant, dict.fromkeys(TENANT_COUNTS, 0))

    for state, reqs in (("running", list(scheduler.running)),
                        ("waiting", list(scheduler.waiting))):
        for req in reqs:
            of(req.tenant or "")[f"requests_{state}"] += 1
            if state == "running":
                of(req.tenant or "")["kv_blocks"] += len(req.block_table.blocks)
    for tenant, n in (kv.prefix.held_by_tenant() if kv.prefix else {}).items():
        of(tenant)["cached_blocks"] = n
    if kv.tier is not None:
        for scope, n in kv.tier.store.bytes_by_scope().items():
            of(tenant_name(scope))["disk_bytes"] += n
    return counts


def load_summary(scheduler: Scheduler, kv_bytes_per_block: int) -> dict[str, Any]:
    """What a router weighing a prefill elsewhere needs of this engine (any thread):
    the streams decoding, the prompt tokens queued or being prefilled, the decoding
    streams' mean context, the step cost model's coefficients, the step's token budget
    and how long a step carrying prompt tokens may take."""
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    decoding = [r for r in running if r.remaining_prefill == 1]
    return {"decoding": len(decoding),
            "backlog_tokens": sum(r.remaining_prefill for r in running + waiting
                                  if r.remaining_prefill > 1),
            "context": sum(len(r.token_ids) for r in decoding) // max(1, len(decoding)),
            "costs": dataclasses.asdict(scheduler.costs.coef),
            "budget": scheduler.max_num_batched_tokens,
            "step_limit": scheduler.prefill_step_limit(),
            "kv_bytes_per_block": kv_bytes_per_block}


def snapshot(scheduler: Scheduler, kv: KVCacheManager, commit: Commit, steps: int,
             spec: SpecTotals, disk: dict[str, Any] | None,
             moe: dict[str, Any] | None) -> dict[str, Any]:
    prefix = kv.prefix
    return {
        "requests_running": len(scheduler.running),
        "requests_waiting": len(scheduler.waiting),
        "kv_blocks_total": kv.num_blocks,
        "kv_blocks_used": kv.num_used,
        "prefix_cache_queries": prefix.queries if prefix else 0,
        "prefix_cache_hits": prefix.hits if prefix else 0,
        "preemptions": scheduler.num_preemptions,
        "pace_scale": scheduler.pace.scale,
        # the adapters running and waiting requests use (vLLM's lora_requests_info)
        "lora_running": sorted({r.lora.name for r in scheduler.running if r.lora}),
        "lora_waiting": sorted({r.lora.name for r in scheduler.waiting if r.lora}),
        "tenants": tenant_counts(scheduler, kv),
        "spec": spec.as_dict(),
        "kv_disk": disk,
        "moe": moe,
        "prompt_tokens": commit.prompt_tokens,
        "generation_tokens": commit.generation_tokens,
        "steps": steps,
    }
