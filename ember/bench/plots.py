"""PNG plots of a ``bench serve`` run (matplotlib, an optional dependency).

- ``<prefix>-goodput.png``: request throughput and goodput against offered load;
- ``<prefix>-latency.png``: TTFT and TPOT, median and p99, against offered load, with
  the objectives drawn in;
- ``<prefix>-tenants.png``: each tenant's SLO attainment against offered load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.bench.goodput import Objectives


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'ember[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(row: dict[str, Any]) -> float:
    return row["rate"] if row["rate"] is not None else row["concurrency"]


def plot_steps(rows: list[dict[str, Any]], slo: Objectives, prefix: Path) -> list[Path]:
    plt = _pyplot()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    xlabel = "offered load (requests/s)" if rows[0]["rate"] is not None else "clients"
    by_endpoint: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_endpoint.setdefault(row["endpoint"], []).append(row)
    for series in by_endpoint.values():
        series.sort(key=_load)
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, series in by_endpoint.items():
        xs = [_load(r) for r in series]
        line, = ax.plot(xs, [r["goodput_rps"] for r in series], "o-", label=f"{name} goodput")
        ax.plot(xs, [r["throughput_rps"] for r in series], "s--", color=line.get_color(),
                alpha=0.6, label=f"{name} throughput")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests/s")
    ax.set_title("Throughput and goodput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, prefix, "goodput"))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
    for name, series in by_endpoint.items():
        xs = [_load(r) for r in series]
        for ax, key in ((top, "ttft_s"), (bottom, "tpot_s")):
            line, = ax.plot(xs, [_y(r[key]["median"]) for r in series], "o-",
                            label=f"{name} p50")
            ax.plot(xs, [_y(r[key]["p99"]) for r in series], "^--", color=line.get_color(),
                    label=f"{name} p99")
    for ax, limit, title in ((top, slo.ttft, "time to first token (s)"),
                             (bottom, slo.tpot, "time per output token (s)")):
        if limit is not None:
            ax.axhline(limit, color="black", lw=0.8, ls=":", label="objective")
        ax.set_ylabel(title)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    bottom.set_xlabel(xlabel)
    paths.append(_save(fig, plt, prefix, "latency"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, series in by_endpoint.items():
        tenants = sorted({t for r in series for t in r["per_tenant"]}, key=int)
        for t in tenants:
            ax.plot([_load(r) for r in series],
                    [r["per_tenant"].get(t, {}).get("attainment", 0) * 100 for r in series],
                    "o-", label=f"{name} tenant {t}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests meeting every objective (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("SLO attainment per tenant")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(_save(fig, plt, prefix, "tenants"))
    return paths


def _y(value: float | None) -> float:
    return float("nan") if value is None else value


def _save(fig: Any, plt: Any, prefix: Path, name: str) -> Path:
    path = prefix.parent / f"{prefix.name}-{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
