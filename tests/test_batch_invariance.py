"""q4 is batch-invariant: a request's tokens and logits do not depend on the batch.

The fused native stack computes every token on its own (ember/kernels/fused_decoder.h),
so a seeded request gives the same tokens and, to the bit, the same logprobs alone, in
batches of 2..32 mixed lengths, with any prefill budget, after preemption and with its
prefix served from the cache (for one block size: attention's online softmax is
rescaled a block at a time, so the block size is part of the arithmetic). Checked on
the tiny random-weight model (wide sweeps) and on the real SmolLM2 (the cases users
hit).
"""

from __future__ import annotations

import random

import pytest

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.sampling.params import SamplingParams


def params(i: int, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=3)


def outcomes(engine: LLMEngine, prompts: list[list[int]], sps: list[SamplingParams]):
    """Each request's tokens and every logprob (with the top 3), in request order."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, sps, strict=True)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    if not engine.config.enable_prefix_caching:
        engine.kv.check_no_leaks()
    return [(done[r.request_id].token_ids,
             [(lp.token, lp.logprob, lp.top) for lp in done[r.request_id].logprobs])
            for r in reqs]


def random_prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.slow
def test_tiny_q4_alone_equals_every_batch_size_and_budget(make_tiny_engine):
    prompts = random_prompts(32, seed=7, lo=1, hi=120)
    sps = [params(i) for i in range(32)]
    def make(**options) -> LLMEngine:
        return make_tiny_engine(weights="q4", **{"num_kv_blocks": 512, **options})

    alone = [outcomes(make(), [p], [sp])[0] for p, sp in zip(prompts, sps, strict=True)]
    for size in (2, 5, 32):
        got = outcomes(make(max_num_seqs=32), prompts[:size], sps[:size])
        assert got == alone[:size], f"batch of {size}"
    for budget in (1, 3, 64, 512):
        engine = make(max_num_batched_tokens=budget, max_num_seqs=min(budget, 8))
        assert outcomes(engine, prompts[:8], sps[:8]) == alone[:8], f"budget {budget}"
    tight = make(num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    assert outcomes(tight, prompts[:8], sps[:8]) == alone[:8]
    assert tight.scheduler.num_preemptions > 0
    cached = make(block_size=16)
    outcomes(cached, prompts[:8], sps[:8])  # fills the prefix cache
    again = outcomes(cached, prompts[:8], sps[:8])
    assert again == alone[:8]


def test_tiny_q4_with_q8_0_kv_alone_equals_batched_chunked_preempted_and_cached(
        make_tiny32_engine):
    """Batch invariance holds with a q8_0 pool as with f16: each token's K/V is quantized
    on its own and attention reads the blocks where they lie."""
    prompts = random_prompts(8, seed=7, lo=1, hi=120)
    sps = [params(i) for i in range(8)]

    def make(**options) -> LLMEngine:
        return make_tiny32_engine(weights="q4", kv_dtype="q8_0",
                                  **{"num_kv_blocks": 256, **options})

    alone = [outcomes(make(), [p], [sp])[0] for p, sp in zip(prompts, sps, strict=True)]
    assert outcomes(make(max_num_seqs=8), prompts, sps) == alone
    for budget in (3, 64):
        engine = make(max_num_batched_tokens=budget, max_num_seqs=min(budget, 8))
        assert outcomes(engine, prompts, sps) == alone, f"budget {budget}"
    tight = make(num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    assert outcomes(tight, prompts, sps) == alone
    assert tight.scheduler.num_preemptions > 0
    cached = make(block_size=16)
    outcomes(cached, prompts, sps)  # fills the prefix cache
    assert outcomes(cached, prompts, sps) == alone
    f32_kv = outcomes(make_tiny32_engine(weights="q4", num_kv_blocks=256), prompts[:1], sps[:1])
    assert f32_kv != alone[:1]  # the logprobs do see the quantized K/V


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "1, 1, 2, 3, 5, 8,",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. In plants it",
    "To make a cup of tea, first",
]


@pytest.mark.slow
def test_smollm2_q4_alone_equals_batched_chunked_preempted_and_cached(smollm2_q4):
    loaded = smollm2_q4
    prompts = [loaded.encode_prompt(t) for t in TEXTS]
    sps = [params(i, max_tokens=10) for i in range(len(prompts))]

    def make(**options) -> LLMEngine:
        options.setdefault("num_kv_blocks", 256)
        return LLMEngine(EngineConfig(model=str(loaded.path), weights="q4", **options),
                         loaded=loaded)

    alone = [outcomes(make(), [p], [sp])[0] for p, sp in zip(prompts, sps, strict=True)]
    assert outcomes(make(), prompts, sps) == alone
    for budget in (1, 7, 512):
        engine = make(max_num_batched_tokens=budget, max_num_seqs=min(budget, 6))
        assert outcomes(engine, prompts, sps) == alone, f"budget {budget}"
    # the same block size throughout: attention's online softmax works a block at a time
    tight = make(num_kv_blocks=8, enable_prefix_caching=False)
    assert outcomes(tight, prompts, sps) == alone
    assert tight.scheduler.num_preemptions > 0
    cached = make()
    outcomes(cached, prompts, sps)
    assert outcomes(cached, prompts, sps) == alone
