"""Lossless engine transformations on the real SmolLM2 model, in the q4 format (the fused
native stack computes every token the same way whatever the batch: equality is exact).

A request's stream alone, batched, chunked, preempted and served from the prefix cache
is checked in tests/test_batch_invariance.py; here, a follow-up turn from the cache, and
the cache's scope: another tenant's identical prompt computes everything.
"""

from __future__ import annotations

import pytest

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

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
def make_engine(smollm2_q4):
    def make(**options) -> LLMEngine:
        options.setdefault("num_kv_blocks", 512)
        return LLMEngine(EngineConfig(model=str(smollm2_q4.path), weights="q4", **options),
                         loaded=smollm2_q4)

    return make


def test_prefix_served_from_cache_is_lossless_and_tenant_scoped(make_engine, smollm2_q4):
    history = [{"role": "user", "content": "Tell me one fact about the Moon. " * 8}]
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    ids = smollm2_q4.encode_chat(history)
    first = engine.add_request(ids, params, tenant="alice")
    while engine.has_unfinished():
        engine.step()
    turn2 = smollm2_q4.encode_chat(history + [
        {"role": "assistant", "content": engine.tokenizer.decode(first.output_ids)},
        {"role": "user", "content": "And one about Mars?"}])
    reqs = {t: engine.add_request(turn2, params, tenant=t) for t in ("alice", "bob")}
    while engine.has_unfinished():
        engine.step()
    assert reqs["alice"].cached_tokens >= len(ids) // 16 * 16 - 16
    assert reqs["bob"].cached_tokens == 0
    fresh_engine = make_engine()
    fresh = fresh_engine.add_request(turn2, params)
    while fresh_engine.has_unfinished():
        fresh_engine.step()
    for req in reqs.values():  # bitwise what a cold engine computes, tokens and logprobs
        assert req.output_ids == fresh.output_ids
        assert [(lp.token, lp.logprob) for lp in req.logprobs] == \
            [(lp.token, lp.logprob) for lp in fresh.logprobs]
    engine.kv.check_no_leaks()
