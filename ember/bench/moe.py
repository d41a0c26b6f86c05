"""``ember bench moe``: a mixture-of-experts model resident vs streamed from disk.

For the model (``--model``, a qwen3moe GGUF; default: a random-weight one of ~430 MB
of experts written once into ``$EMBER_HOME/bench/``), each configuration runs in a
fresh child process, so its peak RSS is its own:

- resident: every expert built at load;
- streamed at ``--budgets`` (percent of all experts' built bytes), twice: ``cold``
  (no usage histogram: nothing pinned) and ``pinned`` (the histogram the cold run
  saved pins the hottest experts at start).

Before every run the model file's pages are dropped from the page cache with
``posix_fadvise(DONTNEED)``, so expert reads (and a resident load) come from the
device, not from memory left by the previous run. Each child greedily decodes
``--tokens`` tokens for each of a few prompts, one stream at a time, and reports
decode tok/s, the expert lookups (pinned / LRU hits, misses), bytes read, hit rate
and its peak RSS, checked against dense weights + budget + 300 MB.

Random weights route roughly uniformly, so an LRU's hit rate is about its share of
the experts; real models' routing is skewed, which pinning exploits more.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUNTIME_ALLOWANCE = 300 * 1024**2  # the RSS target's allowance for the runtime
PROMPTS = ["The history of the river begins", "def parse(line):", "In the morning the market"]


def bench_model_path() -> Path:
    from ember.models.registry import ember_home

    return ember_home() / "bench" / "moe-bench-q8.gguf"


def ensure_bench_model(path: Path) -> Path:
    """Write the synthetic benchmark model if it is not there (~1 minute, once)."""
    if path.is_file():
        return path
    from ember.bench.moe_model import write_moe_gguf
    from ember.models.gguf import GGUFFile
    from ember.models.registry import ensure_model

    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing the benchmark model {path} (random weights, once)", file=sys.stderr)
    tmp = path.with_name(path.name + ".partial")
    write_moe_gguf(tmp, GGUFFile(ensure_model("smollm2-135m")), n_layers=8, hidden=512,
                   n_heads=8, n_kv_heads=4, head_dim=64, n_experts=32, n_used=4,
                   expert_ffn=1024, seed=0)
    os.replace(tmp, path)
    return path


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    import torch

    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.sampling.params import SamplingParams

    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=spec["model"], weights=spec["weights"],
                                    threads=spec["threads"], num_kv_blocks=64,
                                    speculation="off", moe_stream=spec["stream"],
                                    moe_cache_bytes=spec["cache_bytes"] or 1))
    load = time.perf_counter() - start
    loaded = engine.loaded
    tokens, seconds = 0, 0.0
    for text in PROMPTS:
        req = engine.add_request(loaded.encode_prompt(text),
                                 SamplingParams(temperature=0, max_tokens=spec["tokens"],
                                                ignore_eos=True))
        engine.step()  # prefill and the first token
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds += time.perf_counter() - t0
        tokens += len(req.output_ids) - 1
    engine.close()  # saves the histogram
    experts = loaded.model.experts
    store_bytes = experts.cached_bytes
    return {"load_s": round(load, 3), "decode_tok_s": round(tokens / seconds, 2),
            **engine.moe_metrics(), "cached_bytes": store_bytes,
            "peak_rss": peak_rss()}


def peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux carries the
    pre-exec process's peak into it, so a child forked from a big parent reports the
    parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "ember.bench.moe", json.dumps(spec)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"bench child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sizes(model: str, weights: str) -> tuple[int, int]:
    """(all experts' built bytes, the dense weights' built bytes) in ``weights``."""
    from ember.models.footprint import weight_bytes
    from ember.models.loader import load_model

    m = load_model(model, weights).model
    assert m.experts is not None, f"{model} is not a mixture-of-experts model"
    return m.experts.cached_bytes, weight_bytes(m) - m.experts.cached_bytes


def main(model: str | None, weights: str, threads: int | None, budgets: list[int],
         tokens: int, out: Path) -> dict[str, Any]:
    from ember.models.linear import resolve_weights
    from ember.models.loader import physical_cores
    from ember.models.moe import HISTOGRAM_SUFFIX

    path = Path(model) if model else ensure_bench_model(bench_model_path())
    weights = resolve_weights(weights)
    threads = threads or physical_cores()
    expert_bytes, dense_bytes = _sizes(str(path), weights)
    sidecar = Path(str(path) + HISTOGRAM_SUFFIX)
    base = {"model": str(path), "weights": weights, "threads": threads, "tokens": tokens}
    print(f"{path.name}: experts {expert_bytes / 1e6:.0f} MB, dense weights "
          f"{dense_bytes / 1e6:.0f} MB ({weights}), {threads} threads, {tokens} tokens x "
          f"{len(PROMPTS)} prompts, page cache dropped before each run")
    print(f"{'config':<18}{'tok/s':>8}{'hit rate':>10}{'pinned':>8}{'lru':>7}{'miss':>7}"
          f"{'read MB':>9}{'RSS MB':>8}{'bound MB':>9}")
    rows = []
    configs = [("resident", False, None, False)]
    for pct in budgets:
        configs += [(f"{pct}% cold", True, pct, True), (f"{pct}% pinned", True, pct, False)]
    for name, stream, pct, cold in configs:
        if cold:
            sidecar.unlink(missing_ok=True)
        drop_page_cache(path)
        cache = int(expert_bytes * pct / 100) if pct else 0
        r = _run_child({**base, "stream": stream, "cache_bytes": cache})
        bound = dense_bytes + (cache if stream else expert_bytes) + RUNTIME_ALLOWANCE
        row = {"config": name, "budget_pct": pct, "cache_bytes": cache, "rss_bound": bound,
               "rss_within_bound": r["peak_rss"] <= bound, **r}
        rows.append(row)
        print(f"{name:<18}{r['decode_tok_s']:>8.1f}{r['hit_rate']:>10.1%}"
              f"{r['pinned_hits']:>8}{r['lru_hits']:>7}{r['misses']:>7}"
              f"{r['bytes_read'] / 1e6:>9.1f}{r['peak_rss'] / 1e6:>8.0f}{bound / 1e6:>9.0f}")
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "python": platform.python_version()},
              "expert_bytes": expert_bytes, "dense_bytes": dense_bytes, **base, "runs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
