"""``ember bench isolation``: can one tenant time another's prefix cache?

Tenant A caches a random prompt; tenant B then times its own prefill (to the first
token) of that prompt and of a fresh one of the same length, in random order. The AUC
of "A's prompt came back faster" (Mann-Whitney) is 0.5 when B learns nothing; A
probing its own cache is the positive control (near 1). Run with per-tenant quotas on
and also through a LoRA adapter. The figures are wall-clock and vary with the load:
this is a measurement, not a test (the tests check the cause: B's probe hits nothing
and computes its whole prompt).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from ember.config import EngineConfig, TenantLimits
from ember.engine.engine import LLMEngine
from ember.sampling.params import SamplingParams


def auc(faster: list[float], slower: list[float]) -> float:
    """P(a value of ``faster`` < one of ``slower``), ties half (Mann-Whitney)."""
    import bisect

    ordered = sorted(slower)
    wins = sum(len(ordered) - bisect.bisect_right(ordered, a)
               + 0.5 * (bisect.bisect_right(ordered, a) - bisect.bisect_left(ordered, a))
               for a in faster)
    return wins / (len(faster) * len(slower))


def timing_auc(engine: LLMEngine, victim: str, probe: str, lora: str | None, trials: int,
               prompt_len: int = 192, seed: int = 0) -> float:
    """The AUC of ``probe``'s prefill times of prompts ``victim`` cached vs fresh ones."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=1)
    vocab = engine.loaded.config.vocab_size

    def ttft(prompt: list[int], tenant: str) -> float:
        t = time.perf_counter()
        engine.add_request(prompt, params, tenant=tenant, lora=lora)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t

    def text() -> list[int]:
        return [rng.randrange(100, min(vocab, 4000)) for _ in range(prompt_len)]

    cached: list[float] = []
    fresh: list[float] = []
    for _ in range(trials):
        secret = text()
        ttft(secret, victim)
        tries = [(cached, secret), (fresh, text())]
        rng.shuffle(tries)
        for into, prompt in tries:
            into.append(ttft(prompt, probe))
    return auc(cached, fresh)


def main(model: str, weights: str, threads: int | None, trials: int, out: Path) -> dict:
    from ember.bench.lora import write_random_adapter

    engine = LLMEngine(EngineConfig(model=model, weights=weights, threads=threads,
                                    tenant_limits={"*": TenantLimits(kv_share=0.25,
                                                                     max_adapters=1)}))
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_random_adapter(engine.loaded.config, 4, 1, Path(tmp) / "a.gguf")
        engine.load_lora("a", str(adapter))
        engine.step()  # warm
        result: dict[str, Any] = {
            "model": model, "trials": trials,
            "own_cache_auc": timing_auc(engine, "a", "a", None, max(10, trials // 5)),
            "other_tenant_auc": timing_auc(engine, "a", "b", None, trials),
            "other_tenant_adapter_auc": timing_auc(engine, "a", "b", "a", trials),
        }
    print(f"timing AUC, tenant A probing its own cache (control): "
          f"{result['own_cache_auc']:.3f}")
    print(f"timing AUC, tenant B probing A's cache: {result['other_tenant_auc']:.3f} "
          f"(0.5: no signal; spread under no signal ~{0.5 / trials ** 0.5:.3f})")
    print(f"  through adapter 'a': {result['other_tenant_adapter_auc']:.3f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result
