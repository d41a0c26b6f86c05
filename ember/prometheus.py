"""The Prometheus text exposition format, written by hand (no dependency): a metric
family's lines and a histogram. A leaf: the server's metrics and the replica front's
render through it."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 30.0, 60.0)


def family(name: str, kind: str, help: str, rows: Iterable[tuple[str, Any]]) -> list[str]:
    """One metric family in the text format: HELP, TYPE, then a sample per
    ``(labels, value)`` row (labels already formatted, ``{k="v"}`` or empty)."""
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
            *(f"{name}{labels} {value}" for labels, value in rows)]


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self) -> list[str]:
        lines = family(self.name, "histogram", self.help, [])
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.n}')
        lines += [f"{self.name}_sum {self.total}", f"{self.name}_count {self.n}"]
        return lines
