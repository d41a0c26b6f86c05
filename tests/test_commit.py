"""The commit is the one writer of a request's progress, and it keeps the invariant.

A property test drives random schedules — prefill budgets, a pool small enough to
preempt, speculation with drafts accepted and rejected, n > 1 forks, aborts — and
checks after every step that each running request holds exactly the blocks its
cached positions need and that a decoding one has exactly its newest token uncached.
The engine bug the invariant guards against is forced directly: a commit given a
stale row raises ``InvalidDecodeState``, and the engine lets it through instead of
failing one request.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_properties import check_invariants
from test_speculation import Random

from ember.engine.costs import Coefficients, StepCostModel
from ember.engine.runner import ScheduledRow
from ember.errors import InvalidDecodeState
from ember.kv.blocks import blocks_for
from ember.sampling.params import SamplingParams

# steps that cost next to nothing per token: the gate grants every draft it is offered
DRAFTS_PAY = Coefficients(0.01, 1e-5, 0.0, 0.0, 0.0)

event = st.one_of(
    st.tuples(st.just("add"), st.integers(2, 30), st.integers(1, 12), st.integers(0, 5),
              st.integers(1, 2), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 6)),
)


def step_and_check(engine) -> None:
    """One step, then: the invariants of tests/test_engine_properties.py; no block kept
    past a running request's cached positions (a rejected draft's are given back); and
    a request that was decoding, and was not preempted, still has exactly its newest
    token uncached (however many drafts it verified)."""
    decoding = {r: r.admitted_seq for r in engine.scheduler.running if r.remaining_prefill == 1}
    engine.step()
    check_invariants(engine)
    bs = engine.kv.block_size
    for req in engine.scheduler.running:
        assert len(req.block_table.blocks) == blocks_for(req.kv_len, bs), req.request_id
        if decoding.get(req) == req.admitted_seq:
            assert len(req.token_ids) == req.kv_len + 1, req.request_id


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(event, min_size=1, max_size=30), budget=st.sampled_from([4, 16, 64]))
def test_random_schedules_with_drafts_keep_the_invariant(make_tiny_engine, events, budget):
    engine = make_tiny_engine(num_kv_blocks=12, block_size=4, max_num_seqs=4,
                              max_num_batched_tokens=budget, max_model_len=48)
    engine.scheduler.costs = StepCostModel(DRAFTS_PAY, learn=False)
    ids: list[str] = []
    for ev in events:
        if ev[0] == "add":
            _, plen, max_tokens, seed, n, greedy = ev
            # a repeating prompt: the conversation source finds matches to draft from
            prompt = ([5, 6, 7, 8, 9] * 8)[seed:seed + plen]
            params = [SamplingParams(temperature=0 if greedy else 0.9, seed=seed + j,
                                     max_tokens=max_tokens, ignore_eos=True)
                      for j in range(n)]
            ids += [r.request_id for r in engine.add_group(prompt, params)]
        elif ev[0] == "abort" and ids:
            engine.abort(ids[ev[1] % len(ids)])
        else:
            for _ in range(ev[1]):
                step_and_check(engine)
    steps = 0
    while engine.has_unfinished():
        step_and_check(engine)
        steps += 1
        assert steps < 2000, "a request starved"
    engine.kv.check_no_leaks()


def test_drafts_are_verified_accepted_and_rejected_under_the_invariant(make_tiny_engine):
    """The schedules above do speculate: on this workload drafts are verified and
    accepted; with a source of random drafts beside them, rejected too — the invariant
    checked at every step."""
    engine = make_tiny_engine(num_kv_blocks=64, block_size=4, max_num_seqs=4)
    engine.scheduler.costs = StepCostModel(DRAFTS_PAY, learn=False)
    reqs = [engine.add_request([5, 6, 7, 8, 9] * 4, SamplingParams(
        temperature=0 if i % 2 else 0.9, seed=i, max_tokens=24, ignore_eos=True))
        for i in range(4)]
    for i, req in enumerate(reqs[2:]):  # these two draft random tokens
        req.speculator.sources = [Random(i)]
        req.speculator.tracks = {"conversation": req.speculator.tracks["conversation"]}
    while engine.has_unfinished():
        step_and_check(engine)
    stats = [r.speculator.stats for r in reqs]
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    assert 0 < accepted < drafted, (drafted, accepted)
    engine.kv.check_no_leaks()


def _decoding(make_tiny_engine):
    engine = make_tiny_engine()
    req = engine.add_request([3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))
    while req.num_output < 2:
        engine.step()
    return engine, req


def test_a_commit_from_a_stale_row_is_an_invalid_decode_state(make_tiny_engine):
    engine, req = _decoding(make_tiny_engine)
    stale = ScheduledRow(req, 1, start=req.kv_len - 1)  # as if one position were missing
    with pytest.raises(InvalidDecodeState, match=req.request_id):
        engine.commit.sampled(stale, [(7, None)])


def test_the_cache_never_moves_back_in_a_commit(make_tiny_engine):
    engine, req = _decoding(make_tiny_engine)
    row = ScheduledRow(req, 1)
    row.start -= 2  # the row claims to start before what is cached, and is no sampler
    row.samples = False
    with pytest.raises(InvalidDecodeState, match="move back"):
        engine.commit.computed(row)


def test_the_engine_stops_on_an_invalid_decode_state_instead_of_failing_a_request(
        make_tiny_engine, monkeypatch):
    engine, req = _decoding(make_tiny_engine)
    real = engine.commit.sampled

    def stale(row, results, *rest):
        row.start -= 1
        return real(row, results, *rest)

    monkeypatch.setattr(engine.commit, "sampled", stale)
    with pytest.raises(InvalidDecodeState):
        engine.step()
    assert req.error is None  # not turned into this request's error
