"""``ember bench moe``: a mixture-of-experts model resident vs streamed from disk.

Two runs of the same command, each configuration in a fresh child process so its peak
RSS is its own, the model's pages dropped from the page cache before each
(``posix_fadvise(DONTNEED)`` on every part), so expert reads come from the device:

- Cache budgets (default): resident, then streamed at ``--budgets`` (percent of all
  experts' built bytes), twice each: ``cold`` (no usage histogram) and ``warm`` (the
  histogram the cold run saved fills the cache with the hottest experts at start).
  Each child greedily decodes ``--tokens`` tokens for each of a few prompts, one stream
  at a time, and reports decode tok/s, the expert lookups (pinned / LRU hits, misses),
  bytes read, hit rate, the pilot's recall and its peak RSS, checked against dense
  weights + budget + 300 MB. ``--model trained`` runs ember's own trained MoE
  (:mod:`ember.bench.moe_train`), whose routing follows its text: the pilot's recall and
  what a learned pinned set buys are measured there, not on random routing.
- Bigger than RAM (``--memory-limit``): every run inside a memory cgroup of that size,
  page cache included (:mod:`ember.bench.cgroup`): ember ``--moe-stream`` with
  ``--cache-bytes``, cold (prompt A), then warm from the histogram it saved (prompt A
  again, then prompt B), then cold on prompt B (B's own baseline), against llama.cpp's
  llama-bench (``--llama-bench``: mmap, the
  OS pages it; ``--repack 0``, as repacking copies the weights into anonymous memory)
  on the same file and limit, 1 stream, ``--tokens`` tokens. ember's streamed tokens
  are checked against a resident run outside the limit (bitwise), when the machine
  holds the model (``--no-resident`` skips it).

Random weights do not route like a trained model: a deep random network's residual
stream is dominated by a few directions, so its later layers send most tokens to a few
experts (the 48-layer 30B-A3B shape: 17-19 of 128 in 32-token runs), which flatters any
cache. The trained model routes by its text.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RUNTIME_ALLOWANCE = 300 * 1024**2  # the RSS target's allowance for the runtime
PROMPTS = ["The history of the river begins", "def parse(line):", "In the morning the market"]


def bench_model_path() -> Path:
    from ember.models.files import ember_home

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


def resolve_bench_model(model: str | None) -> Path:
    """``--model``: a path, ``trained`` (ember's trained MoE), or None (random weights)."""
    if model == "trained":
        from ember.bench.moe_train import ensure_trained_moe

        return ensure_trained_moe()
    return Path(model) if model else ensure_bench_model(bench_model_path())


def model_files(path: Path) -> list[Path]:
    """Every file of the model named by ``path`` (a split model's parts)."""
    from ember.models.gguf import GGUFFile

    with GGUFFile(path) as gguf:
        return [p for p, _ in gguf.parts]


def drop_page_cache(files: list[Path]) -> None:
    """Drop the model's files' pages from the page cache."""
    for part in files:
        fd = os.open(part, os.O_RDONLY)
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
                                    moe_cache_bytes=spec["cache_bytes"] or 1,
                                    moe_pilot=spec["pilot"]))
    load = time.perf_counter() - start
    loaded = engine.loaded
    tokens, seconds, prefill, outputs = 0, 0.0, 0.0, []
    for text in spec.get("prompts", PROMPTS):
        req = engine.add_request(loaded.encode_prompt(text),
                                 SamplingParams(temperature=0, max_tokens=spec["tokens"],
                                                ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()  # prefill and the first token
        t1 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        prefill += t1 - t0
        seconds += time.perf_counter() - t1
        tokens += len(req.output_ids) - 1
        outputs.append(list(req.output_ids))
    engine.close()  # saves the histogram
    experts = loaded.model.experts
    store_bytes = experts.cached_bytes
    return {"load_s": round(load, 3), "prefill_s": round(prefill, 3),
            "decode_tok_s": round(tokens / seconds, 2), **engine.moe_metrics(),
            "cached_bytes": store_bytes, "peak_rss": peak_rss(), "outputs": outputs}


def peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux carries the
    pre-exec process's peak into it, so a child forked from a big parent reports the
    parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run_child(spec: dict[str, Any], preexec_fn: Callable[[], None] | None = None
               ) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "ember.bench.moe", json.dumps(spec)],
                         capture_output=True, text=True, check=False, preexec_fn=preexec_fn)
    if out.returncode:
        raise RuntimeError(f"bench child exited with {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sizes(model: str, weights: str) -> tuple[int, int]:
    """(all experts' built bytes, the dense weights' built bytes) in ``weights``."""
    from ember.models.footprint import weight_bytes
    from ember.models.loader import load_model

    m = load_model(model, weights).model
    assert m.experts is not None, f"{model} is not a mixture-of-experts model"
    return m.experts.cached_bytes, weight_bytes(m) - m.experts.cached_bytes


def _machine() -> dict[str, str]:
    return {"cpu": platform.processor() or platform.machine(),
            "python": platform.python_version()}


def _write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def _recall(r: dict[str, Any]) -> str:
    return "-" if r.get("pilot_recall") is None else f"{r['pilot_recall']:.1%}"


def main(model: str | None, weights: str, threads: int | None, budgets: list[int],
         tokens: int, out: Path, pilot: bool = False) -> dict[str, Any]:
    """The cache-budget sweep (module doc)."""
    from ember.models.linear import resolve_weights
    from ember.models.loader import physical_cores
    from ember.models.moe import HISTOGRAM_SUFFIX

    path = resolve_bench_model(model)
    files = model_files(path)
    weights = resolve_weights(weights)
    threads = threads or physical_cores()
    expert_bytes, dense_bytes = _sizes(str(path), weights)
    sidecar = Path(str(path) + HISTOGRAM_SUFFIX)
    base = {"model": str(path), "weights": weights, "threads": threads, "tokens": tokens,
            "pilot": pilot}
    print(f"{path.name}: experts {expert_bytes / 1e6:.0f} MB, dense weights "
          f"{dense_bytes / 1e6:.0f} MB ({weights}), {threads} threads, {tokens} tokens x "
          f"{len(PROMPTS)} prompts, page cache dropped before each run")
    print(f"{'config':<18}{'tok/s':>8}{'hit rate':>10}{'pinned':>8}{'lru':>7}{'miss':>7}"
          f"{'read MB':>9}{'pilot':>8}{'RSS MB':>8}{'bound MB':>9}")
    rows = []
    configs = [("resident", False, None, False)]
    for pct in budgets:
        configs += [(f"{pct}% cold", True, pct, True), (f"{pct}% warm", True, pct, False)]
    for name, stream, pct, cold in configs:
        if cold:
            sidecar.unlink(missing_ok=True)
        drop_page_cache(files)
        cache = int(expert_bytes * pct / 100) if pct else 0
        r = _run_child({**base, "stream": stream, "cache_bytes": cache})
        bound = dense_bytes + (cache if stream else expert_bytes) + RUNTIME_ALLOWANCE
        row = {"config": name, "budget_pct": pct, "cache_bytes": cache, "rss_bound": bound,
               "rss_within_bound": r["peak_rss"] <= bound, **r}
        rows.append(row)
        print(f"{name:<18}{r['decode_tok_s']:>8.1f}{r['hit_rate']:>10.1%}"
              f"{r['pinned_hits']:>8}{r['lru_hits']:>7}{r['misses']:>7}"
              f"{r['bytes_read'] / 1e6:>9.1f}{_recall(r):>8}{r['peak_rss'] / 1e6:>8.0f}"
              f"{bound / 1e6:>9.0f}")
    same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    print(f"streamed tokens == resident tokens: {same}")
    result = {"machine": _machine(), "expert_bytes": expert_bytes, "dense_bytes": dense_bytes,
              **base, "streamed_equals_resident": same, "runs": rows}
    _write(out, result)
    return result


def main_limit(model: str, weights: str, threads: int | None, limit: int, cache_bytes: int,
               tokens: int, llama_bench: str | None, resident: bool, out: Path,
               pilot: bool = False) -> dict[str, Any]:
    """Bigger than RAM: ember streamed and llama.cpp under one memory cgroup (module doc)."""
    from ember.bench.cgroup import MemoryCgroup
    from ember.models.linear import resolve_weights
    from ember.models.loader import physical_cores

    MemoryCgroup(limit).close()  # refused here, not after the runs without a limit
    path = resolve_bench_model(model)
    files = model_files(path)
    size = sum(f.stat().st_size for f in files)
    base = {"model": str(path), "weights": resolve_weights(weights),
            "threads": threads or physical_cores(), "tokens": tokens, "pilot": pilot,
            "cache_bytes": cache_bytes}
    print(f"{path.name}: {size / 1e9:.2f} GB in {len(files)} file(s), memory limit "
          f"{limit / 1e9:.2f} GB (model = {size / limit:.2f}x the limit, page cache "
          f"included), ember expert cache {cache_bytes / 1e9:.2f} GB, {base['threads']} "
          f"threads, {tokens} tokens, 1 stream, page cache dropped before each run")
    rows = _ember_limited(base, files, limit, resident)
    if llama_bench:
        rows.append(_report(_llama_limited(llama_bench, files, base["threads"], tokens,
                                           limit)))
    _compare(rows)
    result = {"machine": _machine(), "model_bytes": size, "files": [str(f) for f in files],
              "memory_limit": limit, **base, "runs": rows}
    _write(out, result)
    return result


def _ember_limited(base: dict[str, Any], files: list[Path], limit: int, resident: bool
                   ) -> list[dict[str, Any]]:
    """ember's runs: resident on prompts A and B without a limit (the tokens streamed
    runs must equal), then streamed in the limit: cold on A, warm on A and B, cold on B."""
    from ember.bench.cgroup import MemoryCgroup
    from ember.models.moe import HISTOGRAM_SUFFIX

    sidecar = Path(str(files[0]) + HISTOGRAM_SUFFIX)
    prompts = {"A": PROMPTS[0], "B": PROMPTS[1]}
    rows, want = [], {}

    def run(name: str, prompt: str, limited: bool) -> dict[str, Any]:
        drop_page_cache(files)
        spec = {**base, "stream": limited, "prompts": [prompt]}
        if not limited:
            return {"config": name, **_run_child(spec)}
        with MemoryCgroup(limit) as cg:
            try:
                r = _run_child(spec, cg.join)
            except RuntimeError as e:
                return {"config": name, "error": str(e).splitlines()[0],
                        "oom_kills": cg.oom_kills()}
            return {"config": name, **r, "cgroup_peak": cg.peak(), "oom_kills": cg.oom_kills()}

    if resident:
        for key, prompt in prompts.items():
            r = run(f"ember resident, {key} (no limit)", prompt, False)
            want[key] = r.get("outputs")
            rows.append(_report(r))
    for name, key in (("ember streamed, cold, A", "A"), ("ember streamed, warm, A", "A"),
                      ("ember streamed, warm, B", "B"), ("ember streamed, cold, B", "B")):
        if "cold" in name:
            sidecar.unlink(missing_ok=True)
        r = run(name, prompts[key], True)
        if want.get(key) is not None and "outputs" in r:
            r["equals_resident"] = r["outputs"] == want[key]
        rows.append(_report(r))
    return rows


def _report(row: dict[str, Any]) -> dict[str, Any]:
    """Print one run's line; returns it."""
    if "error" in row:
        print(f"{row['config']:<28}{row['error']}")
        return row
    peak = row.get("cgroup_peak")
    print(f"{row['config']:<28}{row['decode_tok_s']:>8.2f} tok/s  load "
          f"{row.get('load_s', 0):>6.1f} s  RSS {row['peak_rss'] / 1e9:>5.2f} GB  cgroup "
          f"peak {'-' if peak is None else f'{peak / 1e9:.2f} GB':>8}  hit "
          f"{row.get('hit_rate', 0):>6.1%}  pilot {_recall(row):>6}")
    return row


def _compare(rows: list[dict[str, Any]]) -> None:
    """Each streamed run against llama.cpp's decode; whether streamed tokens were exact."""
    ember = [r for r in rows if r["config"].startswith("ember streamed") and "error" not in r]
    llama = next((r for r in rows if r["config"].startswith("llama.cpp")
                  and "error" not in r), None)
    if ember and llama:
        for r in ember:
            r["vs_llama_cpp"] = round(r["decode_tok_s"] / llama["decode_tok_s"], 2)
            print(f"{r['config']}: {r['vs_llama_cpp']:.2f}x llama.cpp's decode")
    checked = [r["equals_resident"] for r in ember if "equals_resident" in r]
    if checked:
        print(f"streamed tokens == resident tokens: {all(checked)} ({len(checked)} runs)")


def _llama_limited(llama_bench: str, files: list[Path], threads: int, tokens: int,
                   limit: int) -> dict[str, Any]:
    """llama-bench's decode of ``tokens`` tokens (mmap, no repack) in a cgroup of ``limit``."""
    from ember.bench.cgroup import MemoryCgroup
    from ember.bench.llamacpp_native import locate, parse_bench_json, run_with_peak_rss

    bins = locate(llama_bench)
    argv = [str(bins.bench), "-m", str(files[0]), "-t", str(threads), "-p", "0", "-n",
            str(tokens), "-r", "1", "-o", "json", "--repack", "0", "-lm", "mmap"]
    drop_page_cache(files)
    name = "llama.cpp llama-bench (mmap)"
    with MemoryCgroup(limit) as cg:
        proc = run_with_peak_rss(argv, env=bins.env, preexec_fn=cg.join)
        if proc.returncode != 0:
            return {"config": name, "argv": argv, "oom_kills": cg.oom_kills(),
                    "error": f"exited with {proc.returncode} (oom kills: {cg.oom_kills()})"}
        decode = parse_bench_json(proc.stdout)["decode"]
        return {"config": name, "argv": argv, "decode_tok_s": round(
                    decode["tokens"] / decode["seconds"], 2), "wall_s": round(proc.wall_s, 1),
                "peak_rss": proc.peak_rss_bytes or 0, "cgroup_peak": cg.peak(),
                "oom_kills": cg.oom_kills()}


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
