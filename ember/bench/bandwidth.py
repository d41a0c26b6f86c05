"""How fast this machine reads memory: the ceiling a decode's weight reads are measured
against (``torch.sum`` over a tensor far larger than any cache, checked by
``torch.amax``), and how large a tensor its caches really serve faster than that."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BANDWIDTH_BYTES = 1 << 30


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _read_rates(x: Any, reduce: Any, passes: int) -> list[float]:
    """GB/s (1e9 B) of each of ``passes`` timed ``reduce(x)`` calls over float tensor x."""
    rates = []
    for _ in range(passes):
        start = time.perf_counter()
        reduce(x)
        rates.append(x.nbytes / (time.perf_counter() - start) / 1e9)
    return rates


def measure_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, reps: int = 5) -> dict:
    """Read bandwidth with ``threads`` threads over an ``nbytes`` float32 tensor, bytes / s
    of each pass (GB = 1e9 B): ``reps`` passes of ``torch.sum``, then as many of
    ``torch.amax`` (another reduction kernel over the same bytes: the check)."""
    import torch

    with _torch_threads(threads):
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()  # fault the pages in, warm the threads
        x.amax()
        sums = _read_rates(x, torch.sum, reps)
        amaxes = _read_rates(x, torch.amax, reps)
        del x
    return {"method": f"torch.sum over {nbytes / 2**30:.2f} GiB float32, {threads} threads",
            "gb_s": sums, "median_gb_s": statistics.median(sums),
            "check_method": "torch.amax over the same tensor", "check_gb_s": amaxes}


CHECK_TOLERANCE = 0.25  # the two methods' medians further apart than this: say so

# Reads of a tensor that fits a cache run well above the DRAM rate; this factor over the
# ceiling marks a size as cached. On a 2-core Xeon VM whose sysfs reports a 480 MiB L3,
# torch.sum ran at ~105 GB/s over 4 MiB, ~51 over 16-64 MiB and ~24 (the DRAM rate)
# from 128 MiB up: a 0.75 GB model there is read from DRAM, whatever sysfs says.
CACHED_FACTOR = 1.5
CACHE_PROBE_SMALLEST = 4 << 20
BRACKET = 3  # ceiling passes just before and just after each side's run


def measure_cache_reach(threads: int, largest: int, read_bytes: int = 256 << 20) -> dict:
    """Read bandwidth over float32 tensors of 4 MiB, 8 MiB, ... below ``largest``: the
    median of enough ``torch.sum`` passes to read ``read_bytes`` (at least 3) at each
    size. Where it falls to the DRAM ceiling is the cache decode really has."""
    import torch

    sizes, rates = [], []
    with _torch_threads(threads):
        size = CACHE_PROBE_SMALLEST
        while size < largest:
            x = torch.ones(size // 4, dtype=torch.float32)
            x.sum()  # fault the pages in
            sizes.append(size)
            rates.append(statistics.median(_read_rates(x, torch.sum,
                                                       max(3, read_bytes // size))))
            del x
            size *= 2
    return {"method": f"torch.sum, {threads} threads, median per size", "bytes": sizes,
            "gb_s": rates}


def cache_reach_bytes(reach: dict, ceiling_gb_s: float) -> int:
    """The largest probed size read at least CACHED_FACTOR x the DRAM ceiling (sizes
    past the first one that is not are ignored); 0 when none is."""
    cached = 0
    for size, rate in zip(reach["bytes"], reach["gb_s"], strict=True):
        if rate < CACHED_FACTOR * ceiling_gb_s:
            break
        cached = size
    return cached


def cache_note(step_bytes: int, sysfs_llc: int | None, reach_bytes: int | None) -> str | None:
    """What the cache means for the single-stream figures, or None when nothing needs
    saying: the weights a step reads fit the measured cache (decode can beat the DRAM
    ceiling), or only sysfs's (a VM that reports a cache it does not give)."""
    if reach_bytes and step_bytes <= reach_bytes:
        return (f"note: every side's weights per step ({step_bytes / 1e6:.0f} MB) fit in the "
                f"cache reads were measured from (faster than {CACHED_FACTOR:g}x the DRAM "
                f"ceiling up to {reach_bytes / 2**20:.0f} MiB): decode can exceed the DRAM "
                "ceiling here, and a CPU with a smaller cache will see lower figures")
    if sysfs_llc and step_bytes <= sysfs_llc:
        measured = (f"up to {reach_bytes / 2**20:.0f} MiB" if reach_bytes
                    else "at no probed size")
        return (f"note: sysfs reports a {sysfs_llc / 2**20:.0f} MiB last-level cache, which "
                f"would hold the weights per step ({step_bytes / 1e6:.0f} MB), but reads "
                f"were measured faster than the DRAM ceiling only {measured}: decode here "
                "reads most of its weights from DRAM")
    return None


def bandwidth_ceiling(measurements: list[dict]) -> dict:
    """The ceiling: the median over every ``torch.sum`` pass of every measurement (one
    pass that reads a cache or a lucky interval cannot move it; a best-of did, once
    79.9 GB/s on a machine whose steady value is 46-50), with the min and max beside it,
    and the median of the ``torch.amax`` passes as a check."""
    passes = [g for m in measurements for g in m["gb_s"]]
    check = [g for m in measurements for g in m.get("check_gb_s", [])]
    median = statistics.median(passes)
    out = {"gb_s": median, "min_gb_s": min(passes), "max_gb_s": max(passes),
           "passes": len(passes), "method": measurements[0]["method"]}
    if check:
        out["check_gb_s"] = statistics.median(check)
        out["check_ratio"] = out["check_gb_s"] / median
        out["check_agrees"] = abs(out["check_ratio"] - 1) <= CHECK_TOLERANCE
    return out


def last_level_cache_bytes() -> int | None:
    """Size of this CPU's largest cache (sysfs), or None where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=None)
