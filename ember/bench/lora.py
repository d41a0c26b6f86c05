"""``ember bench lora``: many adapters in one batch against the base model alone.

N greedy streams (distinct prompts, a fixed output length, prefix cache off) run
together twice on one engine: all on the base model, then each with its own LoRA
adapter (random weights, ``--rank`` on all seven projections of every layer, written
as llama.cpp GGUF adapters). Reported side by side in one run, alternating, medians
over ``--reps``: aggregate generated tokens/s of each, their ratio, each adapter's
resident bytes and load time. With ``--llama-server PATH`` llama.cpp's server runs the
same streams with the same adapter files (``--lora`` each, applied per request with
``"lora": [{"id": i, "scale": 1}]``; it does not batch requests whose adapters differ).
Nothing here asserts a timing.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.config import ModelConfig
from ember.models.gguf import TensorToWrite, write_gguf
from ember.models.loader import load_model
from ember.models.lora import TARGETS, projection_shapes
from ember.sampling.params import SamplingParams

WORDS = ("river stone market lantern orchard harbor meadow engine garden letter bridge "
         "winter signal violin compass thunder").split()


def write_random_adapter(cfg: ModelConfig, rank: int, seed: int, out: Path,
                         std: float = 0.01, targets: Sequence[str] = TARGETS) -> Path:
    """A GGUF LoRA adapter of ``rank`` on ``targets`` (default: every projection) of
    every layer (random weights of deviation ``std``: the default keeps the deltas
    small next to the base's outputs)."""
    rng = np.random.default_rng(seed)
    tensors = []
    for layer in range(cfg.n_layers):
        for target in targets:
            n_out, n_in = projection_shapes(cfg)[target]
            for part, shape in (("lora_a", (rank, n_in)), ("lora_b", (n_out, rank))):
                arr = (rng.standard_normal(shape) * std).astype(np.float32)
                tensors.append(TensorToWrite(f"blk.{layer}.{target}.weight.{part}", shape, 0,
                                             lambda arr=arr: [arr]))
    metadata = {"general.architecture": cfg.architecture, "general.type": "adapter",
                "adapter.type": "lora", "adapter.lora.alpha": float(rank)}
    with open(out, "wb") as f:
        write_gguf(f, metadata, tensors)
    return out


def _llama_run(url: str, prompts: list[list[int]], adapters: list[int] | None,
               gen: int) -> float:
    """Aggregate tok/s of the streams on llama-server (each with adapter ``adapters[i]``
    at scale 1, or none)."""
    import httpx

    def one(i: int) -> int:
        body = {"prompt": prompts[i], "n_predict": gen, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False,
                "lora": [] if adapters is None else [{"id": adapters[i], "scale": 1.0}]}
        r = httpx.post(f"{url}/completion", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["tokens_predicted"])

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, range(len(prompts))))
    return tokens / (time.perf_counter() - start)


def _run(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None],
         gen: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.add_request(p, params, lora=lr) for p, lr in zip(prompts, loras,
                                                                     strict=True)]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    return sum(len(r.output_ids) for r in reqs) / wall


def main(model: str, weights: str, threads: int | None, streams: int, rank: int,
         prompt_len: int, gen: int, reps: int, out: Path,
         llama_server: str | None = None, lora_dtype: str = "auto") -> dict[str, Any]:
    loaded = load_model(model, weights)
    engine = LLMEngine(EngineConfig(model=model, weights=weights, threads=threads,
                                    max_num_seqs=max(streams, 1), max_loras=streams,
                                    lora_dtype=lora_dtype, enable_prefix_caching=False,
                                    speculation="off"),
                       loaded=loaded)
    cfg = loaded.config
    loads, nbytes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(cfg, rank, i, Path(tmp) / f"a{i}.gguf")
                 for i in range(streams)]
        for i, path in enumerate(paths):
            start = time.perf_counter()
            adapter = engine.load_lora(f"a{i}", str(path))
            loads.append(time.perf_counter() - start)
            nbytes.append(adapter.nbytes)
        rng = np.random.default_rng(0)
        prompts = []
        for _ in range(streams):
            text = " ".join(rng.choice(WORDS, size=prompt_len))
            prompts.append(loaded.encode_prompt(text)[:prompt_len])
        base_runs, lora_runs = [], []
        _run(engine, prompts, [None] * streams, 4)  # warm up both paths
        _run(engine, prompts, [f"a{i}" for i in range(streams)], 4)
        for _ in range(reps):  # alternating, so drift in the machine hits both alike
            base_runs.append(_run(engine, prompts, [None] * streams, gen))
            lora_runs.append(_run(engine, prompts, [f"a{i}" for i in range(streams)], gen))
        base, lora = statistics.median(base_runs), statistics.median(lora_runs)
        result = {
            "model": str(loaded.path), "weights": weights, "threads": threads,
            "streams": streams, "rank": rank, "prompt_len": prompt_len, "gen": gen,
            "reps": reps, "machine": platform.processor() or platform.machine(),
            "lora_dtype": engine.loras.dtype,
            "base_tok_s": base_runs, "lora_tok_s": lora_runs,
            "base_median": base, "lora_median": lora, "ratio": lora / base,
            "adapter_bytes": statistics.median(nbytes), "load_s": statistics.median(loads),
        }
        print(f"{streams} streams, prompts {prompt_len} tokens, {gen} generated, "
              f"{loaded.path.name} ({weights}), median of {reps}:")
        print(f"  base model           {base:8.1f} tok/s")
        print(f"  {streams} adapters (r={rank}, {engine.loras.dtype:<4}) {lora:8.1f} tok/s   "
              f"{lora / base:.2f}x the base")
        print(f"  per adapter: {statistics.median(nbytes) / 2**20:.1f} MiB resident, "
              f"loaded in {statistics.median(loads) * 1e3:.0f} ms")
        if llama_server:
            result["llama_server"] = _llama_side(llama_server, loaded.path, threads, paths,
                                                 prompts, gen, reps)
            theirs = result["llama_server"]
            print(f"  llama-server: base {theirs['base_median']:.1f} tok/s, {streams} adapters "
                  f"{theirs['lora_median']:.1f} tok/s; ember with adapters "
                  f"{lora / theirs['lora_median']:.2f}x llama-server's")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


def _llama_side(binary: str, gguf: Path, threads: int | None, adapters: list[Path],
                prompts: list[list[int]], gen: int, reps: int) -> dict[str, Any]:
    from ember.bench.spec import LlamaServer

    # --no-repack: llama.cpp's adapters cannot use the repacked weight buffers (AMX on
    # Intel: "cannot use buft 'AMX'", then a crash); plain buffers on every machine
    extra = [a for p in adapters for a in ("--lora", str(p))] + [
        "--lora-init-without-apply", "--no-repack"]
    with LlamaServer(binary, gguf, threads or 2, len(prompts), extra) as url:
        ids = list(range(len(prompts)))
        _llama_run(url, prompts, None, 4)
        _llama_run(url, prompts, ids, 4)
        base_runs, lora_runs = [], []
        for _ in range(reps):
            base_runs.append(_llama_run(url, prompts, None, gen))
            lora_runs.append(_llama_run(url, prompts, ids, gen))
    base, lora = statistics.median(base_runs), statistics.median(lora_runs)
    return {"base_tok_s": base_runs, "lora_tok_s": lora_runs, "base_median": base,
            "lora_median": lora, "ratio": lora / base}
