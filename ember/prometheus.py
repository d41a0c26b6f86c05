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

    def render(self, name: str | None = None, labels: str = "") -> list[str]:
        """The histogram's lines, under ``name`` (default its own) with ``labels``
        (``k="v",...``, without braces) on every sample."""
        name = name or self.name
        more = f",{labels}" if labels else ""
        lines = family(name, "histogram", self.help, [])
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"{more}}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"{more}}} {self.n}')
        tail = f"{{{labels}}}" if labels else ""
        lines += [f"{name}_sum{tail} {self.total}", f"{name}_count{tail} {self.n}"]
        return lines
