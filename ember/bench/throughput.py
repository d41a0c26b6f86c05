"""``ember bench throughput``: aggregate decode speed vs concurrency, and prefix reuse.

Part 1 — for each concurrency C, C greedy requests with fixed, distinct prompts and
a fixed output length run together on one engine; we report aggregate generated
tokens/s over the wall time of the whole batch, and the mean time per output token
(TPOT, first token excluded) seen by each request. The prefix cache is off here so
every run pays for its prompts.

Part 2 — time to first token of a follow-up chat turn whose history is ~1,500
tokens: cold (empty cache) vs with the history cached from the previous turn.

Figures are printed as a table and written as JSON. Nothing here asserts a timing.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.loader import LoadedModel, load_model
from ember.sampling.params import SamplingParams

PARAGRAPH = (
    "The history of computing is a story of abstraction layered on abstraction. Early "
    "machines were programmed by rewiring panels; stored programs made software a thing "
    "of its own; compilers let people write in terms of problems rather than registers. "
    "Each layer hid details that the layer below still had to get right, and each new "
    "generation of engineers learned to trust the layer beneath while measuring it. "
)


@dataclass
class ConcurrencyResult:
    concurrency: int
    output_tokens: int
    wall_s: float
    aggregate_tok_s: float
    mean_tpot_ms: float
    mean_ttft_ms: float


@dataclass
class PrefixResult:
    history_tokens: int
    cold_ttft_ms: float
    cached_ttft_ms: float
    cached_tokens: int

    @property
    def ratio(self) -> float:
        return self.cached_ttft_ms / self.cold_ttft_ms


def _engine(loaded: LoadedModel, **options: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(loaded.path), weights=loaded.weights, **options),
                     loaded=loaded)


def run_concurrency(engine: LLMEngine, concurrency: int, prompt_len: int,
                    output_len: int) -> ConcurrencyResult:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    base = engine.tokenizer.encode(PARAGRAPH * 4)
    prompts = [[100 + i] + base[: prompt_len - 1] for i in range(concurrency)]
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    finished_at = time.monotonic()
    tpots, ttfts = [], []
    for r in reqs:
        assert r.first_token_time is not None
        ttfts.append(r.first_token_time - r.arrival_time)
    # TPOT per request: decode time / (tokens - 1). All requests finish together here,
    # so (finish - first token) is shared up to a step; use the batch finish time.
    for r in reqs:
        tpots.append((finished_at - r.first_token_time) / max(1, output_len - 1))
    total = concurrency * output_len
    return ConcurrencyResult(concurrency, total, wall, total / wall,
                             1000 * statistics.mean(tpots), 1000 * statistics.mean(ttfts))


def run_prefix(loaded: LoadedModel, history_tokens: int, reps: int) -> PrefixResult:
    tok = loaded.tokenizer
    history = (tok.encode(PARAGRAPH) * (history_tokens // 60 + 1))[:history_tokens]
    answer = tok.encode(" Abstraction lets each layer be trusted and measured.")
    follow_up = tok.encode(" Which layer would you measure first, and why?")
    turn2 = history + answer + follow_up
    params = SamplingParams(temperature=0, max_tokens=1)

    def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        req = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start, req.cached_tokens

    cold, cached, hit = [], [], 0
    for _ in range(reps):
        engine = _engine(loaded, max_num_batched_tokens=2048, num_kv_blocks=256)
        cold.append(ttft(engine, turn2)[0])  # nothing cached: the whole prompt is computed
        engine = _engine(loaded, max_num_batched_tokens=2048, num_kv_blocks=256)
        ttft(engine, history + answer)  # turn 1 leaves its blocks in the prefix cache
        t, hit = ttft(engine, turn2)
        cached.append(t)
    return PrefixResult(len(turn2), 1000 * statistics.median(cold),
                        1000 * statistics.median(cached), hit)


def main(model: str, weights: str, concurrencies: list[int], prompt_len: int, output_len: int,
         history_tokens: int, reps: int, out: Path | None, threads: int | None) -> dict:
    loaded = load_model(model, weights)
    engine = _engine(loaded, max_num_seqs=max(concurrencies), max_num_batched_tokens=1024,
                     enable_prefix_caching=False, threads=threads)
    run_concurrency(engine, 2, 8, 4)  # warm-up: first-call allocations and kernel choice
    rows = []
    print(f"model {loaded.name} ({weights}), {torch.get_num_threads()} threads, "
          f"prompt {prompt_len} tok, output {output_len} tok, greedy")
    print(f"{'conc':>5} {'tok/s':>9} {'x single':>9} {'TPOT ms':>9} {'TTFT ms':>9} {'wall s':>8}")
    for c in concurrencies:
        r = run_concurrency(engine, c, prompt_len, output_len)
        rows.append(r)
        base = rows[0].aggregate_tok_s
        print(f"{c:>5} {r.aggregate_tok_s:>9.1f} {r.aggregate_tok_s / base:>9.2f} "
              f"{r.mean_tpot_ms:>9.1f} {r.mean_ttft_ms:>9.0f} {r.wall_s:>8.2f}")
    prefix = run_prefix(loaded, history_tokens, reps)
    print(f"prefix reuse: follow-up turn of {prefix.history_tokens} tokens, "
          f"TTFT cold {prefix.cold_ttft_ms:.0f} ms vs cached {prefix.cached_ttft_ms:.0f} ms "
          f"({100 * prefix.ratio:.1f}% of cold; {prefix.cached_tokens} tokens from cache)")
    result = {
        "benchmark": "throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "threads": torch.get_num_threads()},
        "model": loaded.name, "weights": weights, "prompt_len": prompt_len,
        "output_len": output_len,
        "concurrency": [asdict(r) for r in rows],
        "prefix_reuse": {**asdict(prefix), "ratio": prefix.ratio},
    }
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return result
