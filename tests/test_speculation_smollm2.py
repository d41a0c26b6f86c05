"""Speculation on vs off on the real SmolLM2 with f32 weights: the same committed
streams, alone and in a batch of 16, with stop strings, a grammar, n > 1, preemption
and prefix-cache hits — and drafts really verified (acceptance > 0).

Verify rows change the shape of the batch, which reorders float additions in the
matmuls; a greedy stream may then flip only at a proven near-tie (the rule of
test_engine_smollm2). Seeded streams must be identical.
"""

from __future__ import annotations

import pytest
from test_engine_smollm2 import TEXTS, assert_same_or_near_tie

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
def make_engine(smollm2_llm):
    loaded = smollm2_llm.engine.loaded

    def make(**options) -> LLMEngine:
        options.setdefault("num_kv_blocks", 512)
        # the fixture's f32 KV: rounding K/V to f16 would turn the verify rows' last-bit
        # differences into f16 steps, and near-ties into flips, more often
        options.setdefault("kv_dtype", smollm2_llm.engine.config.kv_dtype)
        return priced_so_drafts_pay(
            LLMEngine(EngineConfig(model=str(loaded.path), **options), loaded=loaded))

    return make


@pytest.fixture(scope="module")
def prompts(smollm2_llm) -> list[list[int]]:
    copy = [smollm2_llm.encode_chat([{"role": "user", "content": f"Copy exactly: {PARAGRAPH}"}]),
            smollm2_llm.encode_chat([{"role": "user", "content":
                                      f"Repeat this twice: {PARAGRAPH[:80]}"}])]
    return copy + [smollm2_llm.encode(t) for t in TEXTS[:14]]


def params_for(i: int, sampled: bool) -> SamplingParams:
    kw = {"temperature": 0.8, "seed": i} if sampled else {"temperature": 0}
    if i % 5 == 3:
        kw["stop"] = [" the"]  # a stop string that may complete inside a verified draft
    return SamplingParams(max_tokens=24, ignore_eos=i % 2 == 0, **kw)


def run(engine: LLMEngine, prompts, params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return reqs


def check(model, prompts, expected, got, sampled: bool) -> None:
    for p, a, b in zip(prompts, expected, got, strict=True):
        if sampled:
            assert a == b
        else:
            assert_same_or_near_tie(model, p, a, b)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculation_changes_no_stream_alone_or_in_a_batch_of_16(make_engine, prompts,
                                                                 smollm2_llm, sampled):
    params = [params_for(i, sampled) for i in range(len(prompts))]
    off = [r.output_ids for r in run(make_engine(speculation="off"), prompts, params)]
    model = smollm2_llm.engine.loaded.model
    batched = run(make_engine(), prompts, params)
    check(model, prompts, off, [r.output_ids for r in batched], sampled)
    stats = [r.speculator.stats for r in batched]
    assert sum(s.accepted for s in stats) > 10  # drafts were verified and accepted
    for i in (0, 1, 3):  # alone: batch 1
        alone = run(make_engine(), [prompts[i]], [params[i]])[0]
        check(model, [prompts[i]], [off[i]], [alone.output_ids], sampled)


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
    assert got[1:] == expected[1:]
    assert got[0] == expected[0]  # greedy JSON: no near-tie met on this prompt
    assert engine.scheduler.num_preemptions > 0 and again.cached_tokens > 0
    engine.kv.check_no_leaks()


@pytest.fixture(scope="module")
def make_q4_engine(smollm2_q4):
    def make(**options) -> LLMEngine:
        return priced_so_drafts_pay(LLMEngine(EngineConfig(
            model=str(smollm2_q4.path), weights="q4", num_kv_blocks=256, **options),
            loaded=smollm2_q4))

    return make


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_q4_speculation_is_lossless_to_the_bit(make_q4_engine, prompts, sampled):
    """q4's fused stack computes every token on its own, so a verify row computes what
    the decode rows it replaces would: on and off give the same tokens and logprobs."""
    make = make_q4_engine
    chosen = prompts[:6]
    params = [SamplingParams(temperature=0.8 if sampled else 0, seed=i, max_tokens=32,
                             ignore_eos=True, logprobs=5) for i in range(len(chosen))]
    off = run(make(speculation="off"), chosen, params)
    on = run(make(), chosen, params)
    # the comparison means something only if drafts were verified and committed (how
    # many depends on the sampled text: 28 seeded, 70 greedy at fixed prices)
    assert sum(r.speculator.stats.accepted for r in on) >= 10

    def outcome(r):
        return r.output_ids, [(lp.token, lp.logprob, lp.top) for lp in r.logprobs]

    assert [outcome(r) for r in on] == [outcome(r) for r in off]
