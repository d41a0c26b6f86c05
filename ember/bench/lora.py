"""``ember bench lora``: many adapters in one batch against the base model alone.

N greedy streams (distinct prompts, a fixed output length, prefix cache off) run
together twice on one engine: all on the base model, then each with its own LoRA
adapter (random weights, ``--rank`` on all seven projections of every layer, written
as llama.cpp GGUF adapters). Reported side by side in one run, alternating, medians
over ``--reps``: aggregate generated tokens/s of each, their ratio, each adapter's
resident bytes and load time. Nothing here asserts a timing.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
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


def write_random_adapter(cfg: ModelConfig, rank: int, seed: int, out: Path) -> Path:
    """A GGUF LoRA adapter of ``rank`` on every projection of every layer (random
    weights, scaled so that the deltas are small next to the base's outputs)."""
    rng = np.random.default_rng(seed)
    tensors = []
    for layer in range(cfg.n_layers):
        for target in TARGETS:
            n_out, n_in = projection_shapes(cfg)[target]
            for part, shape in (("lora_a", (rank, n_in)), ("lora_b", (n_out, rank))):
                arr = (rng.standard_normal(shape) * 0.01).astype(np.float32)
                tensors.append(TensorToWrite(f"blk.{layer}.{target}.weight.{part}", shape, 0,
                                             lambda arr=arr: [arr]))
    metadata = {"general.architecture": cfg.architecture, "general.type": "adapter",
                "adapter.type": "lora", "adapter.lora.alpha": float(rank)}
    with open(out, "wb") as f:
        write_gguf(f, metadata, tensors)
    return out


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
         prompt_len: int, gen: int, reps: int, out: Path) -> dict[str, Any]:
    loaded = load_model(model, weights)
    engine = LLMEngine(EngineConfig(model=model, weights=weights, threads=threads,
                                    max_num_seqs=max(streams, 1), max_loras=streams,
                                    enable_prefix_caching=False, speculation="off"),
                       loaded=loaded)
    cfg = loaded.config
    loads, nbytes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(streams):
            path = write_random_adapter(cfg, rank, i, Path(tmp) / f"a{i}.gguf")
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
        "base_tok_s": base_runs, "lora_tok_s": lora_runs,
        "base_median": base, "lora_median": lora, "ratio": lora / base,
        "adapter_bytes": statistics.median(nbytes), "load_s": statistics.median(loads),
    }
    print(f"{streams} streams, prompts {prompt_len} tokens, {gen} generated, "
          f"{loaded.path.name} ({weights}), median of {reps}:")
    print(f"  base model           {base:8.1f} tok/s")
    print(f"  {streams} adapters (r={rank:<3d})  {lora:8.1f} tok/s   {lora / base:.2f}x the base")
    print(f"  per adapter: {statistics.median(nbytes) / 2**20:.1f} MiB resident, "
          f"loaded in {statistics.median(loads) * 1e3:.0f} ms")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result
