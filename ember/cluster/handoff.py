"""Disaggregated prefill at the front: where a group prefills when handing its prompt to
another replica pays (the planner's rule, :mod:`ember.cluster.disagg`), and the handoff
itself — the prefill replica's KV to the replica that decodes, measured for the planner."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ember.cluster.disagg import Plan, Planner, ReplicaLoad
from ember.cluster.protocol import GroupSpec, Handoff, Verdict
from ember.cluster.remote import RemoteGroup, replica_died
from ember.cluster.router import RoutingView, choose, eligible
from ember.config import EngineConfig

log = logging.getLogger("ember.cluster")


class Handoffs:
    def __init__(self, planner: Planner, view: RoutingView, config: EngineConfig,
                 imbalance: int,
                 dispatch: Callable[[RemoteGroup], Awaitable[tuple[Any, Verdict]]],
                 finish: Callable[[RemoteGroup, str, str | None], None]) -> None:
        """``dispatch``: the front's way to a replica (with failover); ``finish``: how it
        ends a group's requests."""
        self.planner, self.view, self.config, self.imbalance = planner, view, config, imbalance
        self.dispatch, self.finish = dispatch, finish

    def plan(self, spec: GroupSpec) -> Plan | None:
        """Where ``spec`` prefills and decodes, when handing its prefill to another
        replica pays (:mod:`ember.cluster.disagg`); None: route it as usual."""
        if len(spec.prompt_ids) < 2 or not spec.keys or any(
                p.prompt_logprobs is not None for p in spec.params):
            return None  # prompt logprobs are computed where the prompt is, not cached
        stats = self.view.snapshot()
        if len(stats) < 2:
            return None
        loads = {r: ReplicaLoad.of(r, s) for r, s in stats.items()}
        decode = choose(spec.keys, eligible(spec, self.planner.decoders(loads)), self.view,
                        self.imbalance).replica
        bs = self.config.block_size
        cached = self.view.match(decode, spec.keys, time.monotonic()) * bs
        handed = (len(spec.prompt_ids) - 1) // bs * bs  # full blocks before the last token
        cached = min(cached, handed)
        per_block = int(stats[decode].get("load", {}).get("kv_bytes_per_block", 0))
        # only the blocks the decoder lacks travel
        plan = self.planner.plan(loads, decode, handed - cached, cached,
                                 (handed - cached) // bs * per_block)
        return plan if plan.prefill is not None else None

    async def dispatch_prefill(self, group: RemoteGroup) -> tuple[Any, Verdict]:
        """Send the group's prompt to its plan's prefill replica, which validates the
        request as the decoding one would; its stream then yields the handoff."""
        assert group.plan is not None
        prefill = RemoteGroup(dataclasses.replace(
            group.spec, prefill=True, replica=group.plan.prefill or "",
            handoff_from=group.plan.start // self.config.block_size))
        group.prefill_sent = time.monotonic()
        return await self.dispatch(prefill)

    async def hand_over(self, group: RemoteGroup) -> bool:
        """Wait for the prefill's handoff, then dispatch the group to its decoding
        replica with it. A prefill that fails (its replica died) leaves the decoding
        replica to recompute the prompt. Whether the group is now streaming."""
        assert group.plan is not None
        handoff: Handoff | None = None
        try:
            item = await group.prefill.__anext__()
            handoff = item if isinstance(item, Handoff) else None
        except StopAsyncIteration:
            pass
        except Exception as e:
            if not replica_died(e):
                raise
            log.warning("prefill replica died on %s: %r", group.spec.request_id, e)
            self.view.replica_failures += 1
        group.prefill = None
        waited = time.monotonic() - group.prefill_sent
        spec = group.spec
        spec.replica, spec.handoff = group.plan.decode, handoff
        try:
            group.stream, verdict = await self.dispatch(group)
        except Exception as e:
            self._observe(handoff, None, waited)
            self.finish(group, "error", f"no replica could decode the request ({e})")
            return False
        group.replica = verdict.replica
        spec.handoff = None  # taken: let Ray's object store free the blocks
        group.handed_tokens = int((verdict.imported or {}).get("loaded", 0))
        self._observe(handoff, verdict.imported, waited)
        return True

    def _observe(self, handoff: Handoff | None, imported: dict[str, Any] | None,
                         waited: float) -> None:
        """Teach the planner what a handoff measured: its bytes over the time to export
        and import them, and the extra hop's overhead beyond the prefill's engine time."""
        if handoff is None or imported is None:
            self.planner.observe(ok=False)
            return
        ok = not imported.get("error") and imported.get("tokens", 0) >= handoff.tokens
        self.planner.observe(
            ok=ok, kv_bytes=handoff.nbytes,
            transfer_s=handoff.export_seconds + float(imported.get("seconds", 0.0)),
            coordination_s=waited - handoff.engine_seconds - handoff.export_seconds)
