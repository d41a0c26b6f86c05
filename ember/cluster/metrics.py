"""The replica front's metrics: the replicas' engine metrics summed, and the replicas'
and the router's own families in the Prometheus text format."""

from __future__ import annotations

from typing import Any

from ember import prometheus
from ember.cluster.disagg import Planner, disagg_lines
from ember.cluster.router import RoutingView


def replica_lines(v: RoutingView, planner: Planner | None) -> list[str]:
    """Per-replica and router metrics (``planner``: the disaggregation planner's too)."""
    lines: list[str] = []

    def family(name: str, kind: str, help: str, rows: list[tuple[str, Any]]) -> None:
        lines.extend(prometheus.family(name, kind, help, rows))

    stats = v.snapshot()
    replicas = sorted(stats)
    family("ember_replicas", "gauge", "Replicas the router currently sees.",
           [("", len(replicas))])
    family("ember_replica_info", "gauge", "A replica the router sees, with its process id.",
           [(f'{{replica="{r}",pid="{stats[r].get("pid", "")}"}}', 1) for r in replicas])
    family("ember_replica_inflight", "gauge", "Streams this front has open on a replica.",
           [(f'{{replica="{r}"}}', v.load(r)) for r in replicas])
    for key, kind, help in (
            ("requests_running", "gauge", "Requests running on a replica."),
            ("requests_waiting", "gauge", "Requests waiting on a replica."),
            ("prefix_cache_queries", "counter", "Prompt tokens a replica looked up."),
            ("prefix_cache_hits", "counter", "Prompt tokens a replica served from cache.")):
        name = f"ember_replica_{key}" + ("_total" if kind == "counter" else "")
        family(name, kind, help + " (as of its last routing stats)",
               [(f'{{replica="{r}"}}', stats[r].get("metrics", {}).get(key, 0))
                for r in replicas])
    family("ember_router_requests_total", "counter", "Groups routed, by what decided.",
           [(f'{{by="{by}"}}', v.decisions.get(by, 0))
            for by in sorted({"affinity", "load", *v.decisions})])
    family("ember_router_predicted_cached_tokens_total", "counter",
           "Prompt tokens the router predicted cached where it sent them.",
           [("", v.predicted_tokens)])
    family("ember_router_actual_cached_tokens_total", "counter",
           "Prompt tokens the replicas actually served from cache, same requests.",
           [("", v.actual_tokens)])
    family("ember_router_retries_total", "counter",
           "Groups re-dispatched because their replica died before streaming.",
           [("", v.retries)])
    family("ember_router_replica_failures_total", "counter",
           "Streams cut by a replica's death.", [("", v.replica_failures)])
    if planner is not None:
        lines.extend(disagg_lines(planner.metrics()))
    return lines


def merge_into(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, bool) or value is None:
            total.setdefault(key, value)
        elif isinstance(value, int | float):
            total[key] = total.get(key, 0) + value
        elif isinstance(value, dict):
            merge_into(total.setdefault(key, {}), value)
        elif isinstance(value, list | tuple):  # e.g. a draft source's [drafted, accepted]
            mine = total.setdefault(key, [0] * len(value))
            total[key] = [a + b for a, b in zip(mine, value, strict=False)]
