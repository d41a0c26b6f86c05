"""Lossless engine transformations on the real SmolLM2 model.

A request's committed stream must be the same alone, in a batch of 16 mixed lengths,
with a tiny chunked-prefill budget, after preemption, and with its prefix served from
cache. Batch shape changes the order of float additions inside matmuls, so a stream
may legitimately flip where the model is at a near-tie; ``assert_same_or_near_tie``
then proves the first divergence is such a tie (by the logit margin of the two
candidates under teacher forcing) instead of loosening the comparison.
"""

from __future__ import annotations

import pytest

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

NEAR_TIE = 0.05  # logits; float32 reassociation moves logits by ~1e-4 here

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colours of the rainbow:",
    "Water boils at",
    "In 1969, astronauts",
    "The opposite of hot is",
    "My favourite food is",
    "Once upon a time, in a small village,",
    "import numpy as np\n",
    "The largest planet in the solar system",
    "Dear Sir or Madam, I am writing to",
    "1, 1, 2, 3, 5, 8,",
    "Photosynthesis is the process",
    "The quick brown fox",
    "To make a cup of tea, first",
    "The theory of relativity says",
]


@pytest.fixture(scope="module")
def make_engine(smollm2_llm):
    loaded = smollm2_llm.engine.loaded

    def make(**options) -> LLMEngine:
        options.setdefault("num_kv_blocks", 512)
        return LLMEngine(EngineConfig(model=str(loaded.path), **options), loaded=loaded)

    return make


def run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in reqs]


def assert_same_or_near_tie(model, prompt: list[int], expected: list[int], got: list[int]):
    if got == expected:
        return
    k = next(i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b)
    logits = model.score(prompt + expected[:k])[-1]
    margin = abs(float(logits[expected[k]] - logits[got[k]]))
    assert margin < NEAR_TIE, (
        f"streams diverge at output {k} ({expected[k]} vs {got[k]}) with margin {margin:.4f}"
    )


@pytest.fixture(scope="module")
def prompts(smollm2_llm) -> list[list[int]]:
    return [smollm2_llm.encode(t) for t in TEXTS]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_alone_equals_batch_chunked_and_preempted(make_engine, prompts, smollm2_llm, sampled):
    if sampled:
        prompts = prompts[::2]  # 8 of the 16 keep the run short; greedy covers all 16
    params = [SamplingParams(temperature=0.8 if sampled else 0, seed=i, max_tokens=8,
                             ignore_eos=True) for i in range(len(prompts))]
    alone = [run(make_engine(), [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    model = smollm2_llm.engine.loaded.model

    batched = run(make_engine(), prompts, params)
    chunked = run(make_engine(max_num_batched_tokens=5), prompts, params)
    tight = make_engine(num_kv_blocks=14, block_size=4, enable_prefix_caching=False)
    preempted = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for variant in (batched, chunked, preempted):
        for p, a, b in zip(prompts, alone, variant, strict=True):
            if sampled:
                assert a == b  # equal draws, and no tie flipped on this set
            else:
                assert_same_or_near_tie(model, p, a, b)


def test_prefix_served_from_cache_is_lossless_and_tenant_scoped(make_engine, smollm2_llm):
    llm = smollm2_llm
    history = [{"role": "user", "content": "Tell me one fact about the Moon. " * 8}]
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = llm.encode_chat(history)
    first = engine.add_request(ids, params, tenant="alice")
    while engine.has_unfinished():
        engine.step()
    turn2 = llm.encode_chat(history + [
        {"role": "assistant", "content": engine.tokenizer.decode(first.output_ids)},
        {"role": "user", "content": "And one about Mars?"}])
    reqs = {t: engine.add_request(turn2, params, tenant=t) for t in ("alice", "bob")}
    while engine.has_unfinished():
        engine.step()
    assert reqs["alice"].cached_tokens >= len(ids) // 16 * 16 - 16
    assert reqs["bob"].cached_tokens == 0
    fresh = run(make_engine(), [turn2], [params])[0]
    assert_same_or_near_tie(engine.loaded.model, turn2, fresh, reqs["alice"].output_ids)
    engine.kv.check_no_leaks()
