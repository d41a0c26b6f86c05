"""Speculation on vs off on the real SmolLM2 in the q4 format: the same committed
streams, to the bit, alone and in a batch of 16, with stop strings, a grammar, n > 1,
preemption and prefix-cache hits — and drafts really verified (acceptance > 0). (q4's
fused stack computes a verify row's tokens as the decode rows it replaces would; the
f32 path's speculation is checked on the tiny model in tests/test_speculation.py.)
"""

from __future__ import annotations

import pytest
from test_engine_smollm2 import TEXTS

from ember.config import EngineConfig
from ember.engine.costs import Coefficients, StepCostModel
from ember.engine.engine import LLMEngine
from ember.sampling.constraints import StructuredOutput
from ember.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

PARAGRAPH = ("The river runs through the old city, past the market and the library, under "
             "seven stone bridges, and out to the harbor where the fishing boats wait.")


def priced_so_drafts_pay(engine: LLMEngine) -> LLMEngine:
    """Steps priced so that every draft pays, fixed: as many verified drafts as can be,
    whatever this machine's step times (the learned prices follow the wall clock, and a
    loaded machine would otherwise decide how many drafts a test gets to compare)."""
    engine.scheduler.costs = StepCostModel(Coefficients(0.01, 1e-5, 0.0, 0.0, 0.0),
                                           learn=False)
    return engine


@pytest.fixture(scope="module")
def make_engine(smollm2_q4):
    def make(**options) -> LLMEngine:
        options.setdefault("num_kv_blocks", 512)
        return priced_so_drafts_pay(LLMEngine(EngineConfig(
            model=str(smollm2_q4.path), weights="q4", **options), loaded=smollm2_q4))

    return make


@pytest.fixture(scope="module")
def prompts(smollm2_q4) -> list[list[int]]:
    def chat(text: str) -> list[int]:
        return smollm2_q4.encode_chat([{"role": "user", "content": text}])

    copy = [chat(f"Copy exactly: {PARAGRAPH}"), chat(f"Repeat this twice: {PARAGRAPH[:80]}")]
    return copy + [smollm2_q4.encode_prompt(t) for t in TEXTS[:14]]


def params_for(i: int, sampled: bool) -> SamplingParams:
    kw = {"temperature": 0.8, "seed": i} if sampled else {"temperature": 0}
    if i % 5 == 3:
        kw["stop"] = [" the"]  # a stop string that may complete inside a verified draft
    return SamplingParams(max_tokens=24, ignore_eos=i % 2 == 0, logprobs=5, **kw)


def run(engine: LLMEngine, prompts, params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return reqs


def outcome(r) -> tuple:
    return r.output_ids, [(lp.token, lp.logprob, lp.top) for lp in r.logprobs]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculation_changes_no_stream_alone_or_in_a_batch_of_16(make_engine, prompts, sampled):
    """Tokens and logprobs, to the bit."""
    params = [params_for(i, sampled) for i in range(len(prompts))]
    off = [outcome(r) for r in run(make_engine(speculation="off"), prompts, params)]
    batched = run(make_engine(), prompts, params)
    assert [outcome(r) for r in batched] == off
    # the comparison means something only if drafts were verified and committed
    assert sum(r.speculator.stats.accepted for r in batched) > 10
    for i in (0, 1, 3):  # alone: batch 1
        assert outcome(run(make_engine(), [prompts[i]], [params[i]])[0]) == off[i]


def test_speculation_with_a_grammar_n_gt_1_preemption_and_cached_prefixes(make_engine,
                                                                          prompts):
    schema = StructuredOutput.json_schema({
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 60}},
        "required": ["text"]})
    json_params = SamplingParams(temperature=0, max_tokens=40, structured=schema)
    sib = [SamplingParams(temperature=0.8, seed=s, max_tokens=16, ignore_eos=True)
           for s in (1, 2)]

    def go(**options):
        engine = make_engine(num_kv_blocks=24, block_size=8, **options)
        first = engine.add_request(prompts[0], json_params)
        group = engine.add_group(prompts[1], sib)
        rest = [engine.add_request(p, params_for(i, True)) for i, p in enumerate(prompts[2:6])]
        while engine.has_unfinished():
            engine.step()
        again = run(engine, [prompts[0]], [json_params])[0]  # prompt served from cache
        return engine, [r.output_ids for r in [first, *group, *rest, again]], again

    plain, expected, _ = go(speculation="off")
    engine, got, again = go()
    assert got == expected
    assert engine.scheduler.num_preemptions > 0 and again.cached_tokens > 0
    engine.kv.check_no_leaks()
