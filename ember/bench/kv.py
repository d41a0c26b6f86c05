"""``ember bench kv``: what the KV disk tier buys for a long conversation's next turn.

One conversation of about ``--history`` tokens is answered once (its blocks go to the
disk tier), then its follow-up turn (the history, the reply and a new question) is
timed to its first token in four states:

- cold: a fresh engine, an empty disk tier — everything is prefilled;
- RAM hit: the engine that answered the first turn, blocks still in memory;
- disk hit: the same engine after every cached block was evicted from RAM;
- restart: a new engine (the model stays loaded) on the same directory.

For each it prints TTFT (median of ``--reps``), cached tokens and the ratio to cold,
plus the measured restore bandwidth and the crossover: the read bandwidth below which
recomputing would be faster than restoring at this length (what ``--kv-restore auto``
decides by). With ``--drop-caches`` (root) the page cache is dropped before the
restart run, so its blocks come from the device rather than memory.

A hybrid model (recurrent layers: Qwen 3.5) has no disk tier (its recurrent-state
snapshots live in RAM only): it is timed cold and from a RAM hit.
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.loader import LoadedModel, load_model
from ember.sampling.params import SamplingParams

PARAGRAPH = ("The archive keeps the city's maps, deeds and letters from four centuries; "
             "each box is listed by street, by family and by year, and the reading room "
             "lends magnifiers, gloves and a scanner to anyone with a card. ")


def _engine(loaded: LoadedModel, cache_dir: Path, **options: Any) -> LLMEngine:
    disk = {} if loaded.config.recurrent else {"kv_cache_dir": str(cache_dir)}
    config = EngineConfig(model=str(loaded.path), weights=loaded.weights,
                          speculation="off", kv_restore="always", **disk, **options)
    return LLMEngine(config, loaded=loaded)


def _ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of ``prompt`` alone, and its cached tokens."""
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, req.cached_tokens


def _drop_page_cache() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def measure(loaded: LoadedModel, history: int, reps: int, kv_dtype: str,
            drop_caches: bool) -> dict[str, Any]:
    tok = loaded.tokenizer
    text = PARAGRAPH * (history // max(1, len(tok.encode(PARAGRAPH))) + 1)
    first = loaded.encode_chat([{"role": "user", "content": text + "\nSummarise this."}])
    first = first[:history]
    follow = first + tok.encode(" It lists maps by street.\nWhich room lends gloves?")
    times: dict[str, list[float]] = {k: [] for k in ("cold", "ram", "disk", "restart")}
    cached: dict[str, int] = {}
    restore_bps: list[float] = []
    dropped = False
    for _ in range(reps):
        root = Path(tempfile.mkdtemp(prefix="ember-bench-kv-"))
        try:
            cold_engine = _engine(loaded, root / "cold", kv_dtype=kv_dtype)
            t, cached["cold"] = _ttft(cold_engine, follow)
            times["cold"].append(t)
            engine = _engine(loaded, root / "kv", kv_dtype=kv_dtype)
            _ttft(engine, first)  # the first turn: its blocks are cached and spilled
            engine.close()
            t, cached["ram"] = _ttft(engine, follow)
            times["ram"].append(t)
            block_bytes = engine.runner.kv.bytes_per_block
            block_size = engine.config.block_size
            if engine.kv.tier is None:  # a hybrid model: RAM only
                times.pop("disk", None)
                times.pop("restart", None)
                continue
            assert engine.kv.prefix is not None
            engine.kv.prefix.evict(engine.kv.num_blocks)  # RAM forgets, disk keeps
            before = engine.kv.tier.store.stats.bytes_read
            t, cached["disk"] = _ttft(engine, follow)
            times["disk"].append(t)
            restore_bps.append((engine.kv.tier.store.stats.bytes_read - before) / t)
            engine.close()
            if drop_caches:
                dropped = _drop_page_cache()
            restarted = _engine(loaded, root / "kv", kv_dtype=kv_dtype)
            t, cached["restart"] = _ttft(restarted, follow)
            times["restart"].append(t)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    # computing the cached part took (cold - RAM hit); restoring its bytes pays while
    # reading them is faster than that
    restored = cached.get("disk", 0) // block_size * block_bytes
    crossover = restored / max(1e-9, med["cold"] - med["ram"])
    return {"history_tokens": len(follow), "kv_dtype": kv_dtype, "ttft_s": med,
            "cached_tokens": cached, "ratio_to_cold": {k: v / med["cold"] for k, v in
                                                       med.items()},
            "restore_MBps_during_disk_hit": statistics.median(restore_bps or [0]) / 1e6,
            "restored_bytes": restored, "crossover_MBps": crossover / 1e6,
            "page_cache_dropped": dropped}


def main(model: str, weights: str, threads: int | None, history: int, reps: int,
         kv_dtypes: list[str], drop_caches: bool, out: Path) -> None:
    import torch

    from ember.models.loader import physical_cores

    torch.set_num_threads(threads or physical_cores())
    loaded = load_model(model, weights)
    print(f"{loaded.path.name} ({loaded.weights}), {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    results = []
    for kv_dtype in kv_dtypes:
        r = measure(loaded, history, reps, kv_dtype, drop_caches)
        results.append(r)
        print(f"\nfollow-up turn of {r['history_tokens']} tokens, KV {kv_dtype}, "
              f"median of {reps}:")
        print(f"  {'state':<8} {'TTFT':>9} {'cached':>7} {'vs cold':>8}")
        for k in r["ttft_s"]:
            print(f"  {k:<8} {r['ttft_s'][k] * 1e3:>7.1f}ms {r['cached_tokens'][k]:>7} "
                  f"{r['ratio_to_cold'][k]:>7.0%}")
        if "disk" not in r["ttft_s"]:
            print("  (a model with recurrent layers: no disk tier, RAM hits only)")
            continue
        print(f"  effective restore bandwidth (bytes ÷ disk-hit TTFT): "
              f"{r['restore_MBps_during_disk_hit']:.0f} MB/s "
              f"({r['restored_bytes'] / 1e6:.1f} MB restored)")
        print(f"  crossover: restoring pays while disk reads exceed "
              f"{r['crossover_MBps']:.0f} MB/s at this length")
        if drop_caches:
            print(f"  page cache dropped before the restart run: {r['page_cache_dropped']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": loaded.path.name, "weights": loaded.weights,
                               "threads": torch.get_num_threads(), "results": results},
                              indent=1))
    print(f"\nwrote {out}")
