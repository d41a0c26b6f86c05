"""Speculative decoding on the tiny model: drafts change how fast tokens commit, never
which. Adversarial sources, the cascade's choices and mutes, the gate's economics and
failure inside a verify step."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from ember.engine.costs import Coefficients, StepCostModel, StepShape
from ember.engine.engine import LLMEngine
from ember.sampling.params import SamplingParams
from ember.spec import gate
from ember.spec.speculator import Proposal, Speculator


def prompts(n: int, seed: int, lo: int = 10, hi: int = 60) -> list[list[int]]:
    """Prompts that repeat themselves, so the conversation index has matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 40000) for _ in range(rng.randrange(4, 12))]
        out.append((motif * 20)[: rng.randrange(lo, hi)])
    return out


def run(engine: LLMEngine, reqs: list[tuple[list[int], SamplingParams]]) -> list:
    handles = [engine.add_request(p, sp) for p, sp in reqs]
    while engine.has_unfinished():
        engine.step()
    return handles


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=40,
                          ignore_eos=True)


def plain(make, reqs):
    engine = make(speculation="off")
    return [r.output_ids for r in run(engine, reqs)]


class Oracle:
    """Always right: drafts the tokens the plain run committed."""

    name = "conversation"

    def __init__(self, prompt: list[int], expected: list[int]) -> None:
        self.stream = list(prompt)
        self.full = list(prompt) + expected

    def propose(self, budget):
        n = len(self.stream)
        return self.full[n:n + budget], 99

    def observe(self, committed):
        self.stream += committed


class Wrong:
    name = "conversation"

    def propose(self, budget):
        return [1] * budget, 50  # confident and wrong

    def observe(self, committed):
        pass


class Random:
    name = "conversation"

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self, budget):
        return [self.rng.randrange(0, 49152) for _ in range(self.rng.randrange(budget + 1))], 5

    def observe(self, committed):
        pass


class Liar:
    name = "conversation"

    def propose(self, budget):
        return list(range(5, 5 + 3 * budget)) + [10**9, -4], 10**6  # too long, out of vocab

    def observe(self, committed):
        pass


def with_source(engine: LLMEngine, reqs, make_source) -> list:
    handles = []
    for i, (p, sp) in enumerate(reqs):
        r = engine.add_request(p, sp)
        r.speculator.sources = [make_source(i, p)]
        r.speculator.tracks = {"conversation": r.speculator.tracks["conversation"]}
        handles.append(r)
    while engine.has_unfinished():
        engine.step()
    return handles


@pytest.mark.parametrize("kind", ["oracle", "wrong", "random", "liar"])
@pytest.mark.parametrize("params_of", [lambda i: GREEDY, sampled], ids=["greedy", "seeded"])
def test_no_draft_source_can_change_the_committed_stream(make_tiny_engine, kind, params_of):
    ps = prompts(6, seed=1)
    reqs = [(p, params_of(i)) for i, p in enumerate(ps)]
    expected = plain(make_tiny_engine, reqs)
    sources = {"oracle": lambda i, p: Oracle(p, expected[i]), "wrong": lambda i, p: Wrong(),
               "random": lambda i, p: Random(i), "liar": lambda i, p: Liar()}
    engine = make_tiny_engine()
    engine.scheduler.costs = StepCostModel(Coefficients(0.01, 1e-5, 0.0, 0.0, 0.0), learn=False)
    handles = with_source(engine, reqs, sources[kind])
    assert [h.output_ids for h in handles] == expected
    stats = [h.speculator.stats for h in handles]
    if kind == "oracle":
        assert sum(s.accepted for s in stats) > 100 and sum(s.bonus for s in stats) > 0
    elif kind == "wrong":
        assert sum(s.drafted for s in stats) > 0 and sum(s.accepted for s in stats) == 0
    engine.kv.check_no_leaks()


def test_speculation_commits_several_tokens_a_step_and_changes_nothing(make_tiny_engine):
    ps = prompts(16, seed=2)
    reqs = [(p, GREEDY if i % 2 else sampled(i)) for i, p in enumerate(ps)]
    expected = plain(make_tiny_engine, reqs)
    engine = make_tiny_engine()
    engine.scheduler.costs = StepCostModel(Coefficients(0.01, 1e-5, 0.0, 0.0, 0.0), learn=False)
    handles = run(engine, reqs)
    assert [h.output_ids for h in handles] == expected
    committed = sum(len(h.output_ids) for h in handles)
    assert engine.stats["steps"] < committed / 16 * 0.9  # fewer steps than tokens
    assert sum(h.speculator.stats.accepted for h in handles) > 0
    engine.kv.check_no_leaks()


def test_speculation_composes_with_stops_forks_preemption_and_the_prefix_cache(
        make_tiny_engine):
    ps = prompts(4, seed=3, lo=40, hi=60)
    variants = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ps[0][7]]),
                sampled(5)]

    def go(make, **options):
        engine = make(num_kv_blocks=30, block_size=4, **options)
        engine.scheduler.costs = StepCostModel(Coefficients(0.01, 1e-5, 0.0, 0.0, 0.0),
                                               learn=False)
        group = engine.add_group(ps[0], [sampled(11), sampled(12)])
        rest = [engine.add_request(p, variants[i % 2]) for i, p in enumerate(ps)]
        again = engine.add_request(ps[1], variants[1])  # its prompt blocks are cached
        while engine.has_unfinished():
            engine.step()
        return engine, [h.output_ids for h in [*group, *rest, again]]

    plain_engine, expected = go(make_tiny_engine, speculation="off")
    engine, got = go(make_tiny_engine)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0 and plain_engine.scheduler.num_preemptions > 0
    engine.kv.check_no_leaks()


def test_a_failed_verify_step_keeps_every_request_consistent(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    engine.scheduler.costs = StepCostModel(Coefficients(0.01, 1e-5, 0.0, 0.0, 0.0), learn=False)
    handles = [engine.add_request(p, GREEDY) for p in prompts(4, seed=4)]
    for _ in range(4):
        engine.step()
    rows = engine.scheduler.schedule
    seen_drafts = []

    def watching(proposals=None):
        out = rows(proposals)
        seen_drafts.extend(r.draft for r in out.rows if r.draft)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", watching)
    monkeypatch.setattr(engine.runner.model, "forward",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    before = [list(h.token_ids) for h in handles]
    spec_before = [h.speculator.committed for h in handles]
    engine.step()
    assert seen_drafts, "the failing step verified drafts"
    for h, tokens, seen in zip(handles, before, spec_before, strict=True):
        assert h.finish_reason.value == "error"
        assert h.token_ids == tokens and h.speculator.committed == seen  # nothing committed
    engine.kv.check_no_leaks()  # and every block, drafts' included, came back


# ---------------------------------------------------------------- the cascade
class Fixed:
    def __init__(self, name, tokens, match):
        self.name, self.tokens, self.match = name, tokens, match

    def propose(self, budget):
        return self.tokens[:budget], self.match

    def observe(self, committed):
        pass


def speculator(*sources) -> Speculator:
    spec = Speculator([1, 2, 3])
    spec.sources = list(sources)
    spec.tracks = {s.name: spec.tracks.get(s.name) or type(spec.tracks["conversation"])()
                   for s in sources}
    return spec


def test_the_longest_match_wins_and_ties_go_to_the_conversation():
    conv = Fixed("conversation", [7] * 16, 3)
    ref = Fixed("reference", [8] * 16, 5)
    assert speculator(conv, ref).propose().source == "reference"
    ref.match = 3
    assert speculator(conv, ref).propose().source == "conversation"


def test_budget_grows_with_the_match_and_short_matches_fall_back_to_recycling():
    conv = Fixed("conversation", list(range(10, 40)), 2)
    rec = Fixed("recycling", [5, 6, 7, 8, 9], 0)
    p = speculator(conv, rec).propose()
    assert p.source == "conversation" and len(p.tokens) == 2 * (1 + 2)
    conv.match = 1
    p = speculator(conv, rec).propose()
    assert p.source == "recycling" and p.tokens == [5, 6, 7, 8]


def test_a_source_that_stops_earning_is_muted_then_reprobed():
    conv = Fixed("conversation", [7] * 8, 6)
    spec = speculator(conv)
    p = spec.propose()
    spec.feedback(p, 8, 2, bonus=False)  # 25%: still earning
    assert spec.propose() is not None
    spec.feedback(p, 8, 0, bonus=False)  # 2 of 16: under a fifth
    assert spec.propose() is None  # muted
    spec.observe([0] * 127)
    assert spec.propose() is None
    spec.observe([0])
    assert spec.propose() is not None  # re-probed after 128 committed tokens


def test_sources_index_committed_tokens_in_one_call_by_the_next_proposal():
    """Indexing a token after every forward pass runs on cold caches (~5 us a token at
    16 streams, against ~1 us in a batch): the sources get the held tokens at once,
    before any proposal reads them, and never more than PENDING_LIMIT late."""
    from ember.spec.speculator import PENDING_LIMIT

    class Recording(Fixed):
        def __init__(self):
            super().__init__("conversation", [7] * 8, 3)
            self.calls = []

        def observe(self, committed):
            self.calls.append(list(committed))

    src = Recording()
    spec = speculator(src)
    for t in range(10):
        spec.observe([t])
    assert src.calls == []
    spec.propose()
    assert src.calls == [list(range(10))]
    for t in range(PENDING_LIMIT):
        spec.observe([t])
    assert src.calls[1:] == [list(range(PENDING_LIMIT))]


def test_the_conversation_drafts_the_same_whether_its_tokens_came_one_by_one_or_held():
    text = [4, 8, 15, 16, 23, 42, 4, 8]
    eager, held = Speculator([1, 2, 3]), Speculator([1, 2, 3])
    for t in text:
        eager.observe([t])
        eager.propose()  # flushes every token
        held.observe([t])
    assert held.propose().tokens == eager.propose().tokens == [15, 16, 23, 42, 4, 8]


def test_forced_grammar_tokens_lead_and_are_certain():
    class Grammar:
        def forced_tokens(self):
            return [40, 41]

        def valid_prefix_len(self, tokens):
            return 3  # rejects from the fourth token on

    spec = speculator(Fixed("conversation", [7, 8, 9], 4))
    spec.grammar = Grammar()
    p = spec.propose()
    assert p.tokens == [40, 41, 7] and p.forced == 2 and p.reach[:2] == [1.0, 1.0]


def test_drafts_stop_before_an_end_of_generation_token():
    spec = speculator(Fixed("conversation", [7, 8, 2, 9], 4))
    spec.enders = frozenset({2})
    assert spec.propose().tokens == [7, 8]


# ---------------------------------------------------------------- the gate
COSTS = StepCostModel(Coefficients(base=0.008, per_token=0.001, per_row=0.0005,
                                   per_attended=0.0, verify_call=0.0), learn=False)


def proposal(n: int, rate: float) -> Proposal:
    return Proposal([5] * n, "conversation", [rate ** (i + 1) for i in range(n)])


def test_a_lone_stream_verifies_a_likely_draft():
    shape = StepShape(1, 1, 0)
    grant = gate.allocate([("a", proposal(16, 0.9), 100, True)], shape, COSTS, committed=1)
    assert 5 <= grant["a"] <= 16


def test_drafting_stops_when_the_verify_cost_exceeds_the_expected_gain():
    shape = StepShape(1, 1, 0)
    assert gate.allocate([("a", proposal(16, 0.05), 100, True)], shape, COSTS, 1) == {}


def test_at_high_occupancy_only_near_certain_drafts_still_pay():
    shape = StepShape(32, 32, 0)  # 32 streams: 32 tokens a step already
    cands = [(i, proposal(8, rate), 100, True) for i, rate in enumerate([0.6, 0.99])]
    grant = gate.allocate(cands, shape, COSTS, committed=32)
    assert 0 not in grant and grant.get(1, 0) >= 1


def test_hysteresis_needs_a_better_ratio_to_start_than_to_continue():
    shape = StepShape(4, 4, 0)
    # the step: 14 ms for 4 tokens = 286 tok/s; the draft token: 0.3 / 1 ms = 300 tok/s,
    # above the rate but not 10% above it
    cold = gate.allocate([("a", proposal(1, 0.3), 100, False)], shape, COSTS, 4)
    warm = gate.allocate([("a", proposal(1, 0.3), 100, True)], shape, COSTS, 4)
    assert cold == {} and warm == {"a": 1}


def test_the_time_limit_caps_the_draft():
    shape = StepShape(1, 1, 0)
    grant = gate.allocate([("a", proposal(16, 0.99), 100, True)], shape, COSTS, 1,
                          limit=0.013)
    assert grant["a"] == 3  # 9.5 ms + 3 x 1 ms


def test_the_verify_call_beside_decode_rows_is_paid_only_by_drafts_that_cover_it():
    costs = StepCostModel(Coefficients(base=0.008, per_token=0.001, per_row=0.0005,
                                       per_attended=0.0, verify_call=0.004), learn=False)
    shape = StepShape(16, 16, 0, decode_rows=16)  # 32 ms for 16 tokens: 500 tok/s
    # one short draft: worth its tokens (0.9 per ms) but not the 4 ms call beside them
    one = [("a", proposal(2, 0.9), 100, True)]
    assert gate.allocate(one, shape, costs, committed=16) == {}
    assert gate.allocate(one, shape, COSTS, committed=16) == {"a": 2}  # a free call
    # eight such drafts share the call: (16 + 8 x 3.1) tokens in 68 ms = 600 tok/s
    many = [(i, proposal(4, 0.9), 100, True) for i in range(8)]
    assert gate.allocate(many, shape, costs, committed=16) == {i: 4 for i in range(8)}
    # a lone stream that verifies leaves no decode row beside it: no call to pay
    alone = StepShape(1, 1, 0, decode_rows=1)
    assert gate.allocate([("a", proposal(2, 0.9), 100, True)], alone, costs, 1) == {"a": 2}
    # nor when every decode row verifies: 2.8 tokens in 13 ms beat 2 in 11 ms
    both = [(k, proposal(1, 0.4), 100, True) for k in "ab"]
    assert gate.allocate(both, StepShape(2, 2, 0, decode_rows=2), costs, 2) == {"a": 1, "b": 1}


def test_grammar_forced_tokens_are_free_to_take():
    forced = Proposal([1, 2, 3], "grammar", [1.0, 1.0, 1.0], forced=3)
    grant = gate.allocate([("a", forced, 10, False)], StepShape(8, 8, 0), COSTS, 8)
    assert grant == {"a": 3}


def test_torch_free_recycling_feedback_reaches_the_table():
    from ember.spec.index import RecyclingTable

    table = RecyclingTable(100)
    spec = Speculator([1, 2, 3], recycling=table)
    spec.observe_topk([3, 9], torch.tensor([[9, 8, 7, 6, 5, 4, 3, 2], [4, 1, 2, 3, 5, 6, 7, 8]]))
    spec.observe([9])
    p = spec.propose()
    assert table.draft_chain(3, 2) == [9, 4] and p is not None and p.tokens[:1] == [4]


def test_a_step_with_decode_and_verify_rows_pays_the_verify_call():
    shape = StepShape(0, 0, 0).plus(1, 10).plus(3, 12)
    assert shape.split and (shape.decode_rows, shape.verify_rows) == (1, 1)
    assert not StepShape(0, 0, 0).plus(1, 10).plus(100, 100).split  # a prefill chunk
    costs = StepCostModel(Coefficients(0.008, 0.001, 0.0005, 1e-6, 0.004), learn=False)
    same_work = StepShape(4, 2, 46, decode_rows=2)
    assert costs.predict(shape) - costs.predict(same_work) == pytest.approx(0.004)


def test_the_calibration_fit_recovers_a_known_step_time_model():
    """Decode and verify steps of every size and prompt chunks (no logits): the fit
    finds each coefficient and the compute knee."""
    from ember.engine.calibrate import fit

    truth = Coefficients(0.009, 0.001, 0.0011, 2e-6, 0.0035, per_logit=0.0004,
                         per_excess=0.0006, per_draft=0.0003, knee=8)
    model = StepCostModel(truth, learn=False)
    samples = []
    for rows in (1, 2, 4, 8, 16, 32):
        for extra in (0, 1, 4, 16):
            for drafting in {rows, max(1, rows // 4)}:
                shape = StepShape(0, 0, 0)
                for i in range(rows):
                    k = extra if i < drafting else 0
                    shape = shape.plus(1 + k, 96 + i + k, drafts=k)
                samples.append({"tokens": shape.tokens, "rows": shape.rows,
                                "attended": shape.attended, "split": shape.split,
                                "logits": shape.logits, "drafts": shape.drafts,
                                "seconds": model.predict(shape)})
    for n in (64, 256):
        shape = StepShape(0, 0, 0).plus(n, 512 + n, logits=0)
        samples.append({"tokens": n, "rows": 1, "attended": shape.attended, "logits": 0,
                        "drafts": 0, "seconds": model.predict(shape)})
    got = fit(samples)
    assert got.knee == truth.knee
    np.testing.assert_allclose(got.as_array(), truth.as_array(), rtol=1e-6)


def test_past_the_knee_a_draft_token_costs_its_compute():
    """At one stream a draft token rides along with the weights; at sixteen streams,
    past the knee, it pays its whole compute, so only a near-certain draft still pays."""
    costs = StepCostModel(Coefficients(base=0.004, per_token=0.0001, per_row=0.0,
                                       per_attended=0.0, verify_call=0.0, per_logit=0.00005,
                                       per_excess=0.0006, knee=6), learn=False)
    lone, busy = StepShape(1, 1, 0, decode_rows=1, logits=1), StepShape(
        16, 16, 0, decode_rows=16, logits=16)
    assert costs.token_cost(lone, 100) < costs.token_cost(busy, 100) / 4
    likely = Proposal([5] * 4, "conversation", [0.9, 0.85, 0.8, 0.75])
    assert gate.allocate([("a", likely, 10, True)], lone, costs, 1) == {"a": 4}
    # 16 streams: 16 tokens in 0.0124 s; a token costs 0.00075 s: pays if reach > 0.97
    assert gate.allocate([("a", likely, 10, True)], busy, costs, 16) == {}
    sure = Proposal([5] * 2, "conversation", [0.995, 0.99])
    assert gate.allocate([("a", sure, 10, True)], busy, costs, 16) == {"a": 2}


def _proposal_pattern(spec: Speculator, rows: int, steps: int = 200,
                      declined: bool = True) -> list[bool]:
    """Which of ``steps`` steps the speculator proposes in, every proposal turned down
    by the gate (or, with ``declined=False``, finding nothing to draft)."""
    pattern = []
    for _ in range(steps):
        due = spec.due(rows)
        pattern.append(due)
        if due:
            spec.granted(0) if declined else spec.found_nothing()
    return pattern


def _gaps(pattern: list[bool]) -> set[int]:
    due = [i for i, d in enumerate(pattern) if d]
    return {b - a for a, b in zip(due, due[1:], strict=False)}


@pytest.mark.parametrize("rows", [1, 16])
def test_declined_proposals_are_made_less_often_until_one_is_granted(rows):
    """A declined proposal cost its lookups and the gate's pricing, at any batch size."""
    from ember.spec.speculator import MAX_PROPOSE_GAP, REFUSALS_PER_GAP

    spec = Speculator([1, 2, 3])
    pattern = _proposal_pattern(spec, rows)
    assert all(pattern[:REFUSALS_PER_GAP + 1])  # the first refusals cost no gap
    assert _gaps(pattern[REFUSALS_PER_GAP:3 * REFUSALS_PER_GAP]) == {2}  # then doubling
    assert _gaps(pattern[-60:]) == {MAX_PROPOSE_GAP + 1}  # probes only
    spec.granted(3)  # a probe that pays: propose every step again
    assert all(spec.due(rows) for _ in range(REFUSALS_PER_GAP))


def test_finding_nothing_backs_off_by_the_rows_and_a_lone_stream_keeps_looking():
    """A lookup that finds nothing costs per row, a draft gains per step: a lone stream
    looks every step, three rows every third step, sixteen every eighth."""
    from ember.spec.speculator import MAX_PROPOSE_GAP

    def tail(rows):
        return _proposal_pattern(Speculator([1, 2, 3]), rows, declined=False)[-60:]

    assert all(tail(1))
    assert _gaps(tail(3)) == {3}
    assert _gaps(tail(16)) == {MAX_PROPOSE_GAP + 1}


def test_a_busy_batch_with_nothing_to_draft_looks_less_often(make_tiny_engine):
    """Sixteen speculators with nothing to propose (text no source predicts) back off:
    at sixteen streams their lookups cost every step."""
    engine = make_tiny_engine()
    reqs = [engine.add_request([5 + i, 9, 2 + i], SamplingParams(temperature=0, max_tokens=40))
            for i in range(16)]
    for r in reqs:
        r.speculator.propose = lambda: None  # nothing ever matches
    calls = 0
    while engine.has_unfinished():
        before = sum(r.speculator.stats.fallback_steps for r in reqs)
        engine.step()
        calls += sum(r.speculator.stats.fallback_steps for r in reqs) - before
    # without the backoff every request proposes in each of its ~39 decoding steps
    assert 0 < calls < 16 * 39 / 2


@pytest.mark.parametrize("busy", [False, True], ids=["weights-bound", "compute-bound"])
def test_no_draft_is_proposed_in_a_step_where_none_could_pay(make_tiny_engine, busy):
    """Past the knee every token costs its compute: a certain draft token would cost
    more than the step's tokens per second, so the speculators are not even asked (and
    the stream is the same)."""
    ps = prompts(16, seed=4)
    reqs = [(p, GREEDY) for p in ps]
    expected = plain(make_tiny_engine, reqs)
    # (prompts in whole chunks, so that the sixteen streams decode together: a step time
    # limit would spread the prefills and leave a few decoding alone, where drafts pay)
    engine = make_tiny_engine(max_prefill_step_seconds=1e9)
    engine.scheduler.costs = StepCostModel(Coefficients(
        0.01, 1e-5, 0.0, 0.0, 0.0, per_excess=0.01 if busy else 0.0, knee=1), learn=False)
    asked = []
    original = engine._proposals

    def proposals():
        asked.append(1)
        return original()

    engine._proposals = proposals
    handles = run(engine, reqs)
    assert [h.output_ids for h in handles] == expected
    accepted = sum(h.speculator.stats.accepted for h in handles)
    assert (not asked and accepted == 0) if busy else (asked and accepted > 0)
    engine.kv.check_no_leaks()


def test_bench_spec_reports_committed_tokens_per_forward_pass(make_tiny_engine, monkeypatch):
    """``tokens_per_step`` is a request's tokens per forward pass it took part in: 1.0
    when nothing was accepted, and for a lone request its tokens over the engine's
    steps (it was 2.98 for a task that drafted nothing: proposals were counted as steps)."""
    from ember.bench.spec import Task, run_ember

    task = Task("t", [[{"role": "user", "content": "one two three one two three one two"}]], 48)
    engine = make_tiny_engine()
    out = run_ember(engine, task)
    assert out["accepted"] > 0  # the tiny model's greedy text repeats: drafts are accepted
    assert out["tokens_per_step"] == pytest.approx(out["tokens"] / out["steps"])
    monkeypatch.setattr(Speculator, "propose", lambda self: None)
    assert run_ember(make_tiny_engine(), task)["tokens_per_step"] == 1.0


def test_bench_spec_speedup_is_the_median_of_back_to_back_pairs():
    """A slow spell that lands on one rep's pair slows on and off alike: each rep's
    on ÷ off is what counts, not the median of all on runs over all off runs (here
    1.0, though on was twice as fast in two pairs of three)."""
    from ember.bench.spec import _ember_row

    def runs(rates, latencies):
        return [{"tok_s": r, "mean_latency_s": t, "texts": ["same"]}
                for r, t in zip(rates, latencies, strict=True)]

    row = _ember_row({"on": runs([100, 200, 60], [1.0, 1.0, 4.0]),
                      "off": runs([50, 100, 300], [3.0, 1.5, 2.0])})
    assert row["on_tok_s"] == row["off_tok_s"] == 100
    assert row["speedup"] == 2.0 and row["speedup_range"] == [0.2, 2.0]
    # the mean request's latency, off ÷ on per pair: > 1 where on finished requests sooner
    assert row["latency_speedup"] == 1.5 and row["latency_speedup_range"] == [0.5, 3.0]
    assert row["same_output"]


def test_bench_spec_mean_latency_is_each_requests_own_finish(make_tiny_engine):
    """A request's latency ends at the step that finished it, not at the batch's first
    or last: one request capped at 4 tokens beside one of 40 (one token a step, no
    drafts) averages to a little over half of the whole run."""
    from ember.bench.spec import Task, run_ember

    engine = make_tiny_engine(speculation="off")
    task = Task("t", [[{"role": "user", "content": "one two three"}],
                      [{"role": "user", "content": "four five six"}]], 40)
    run_ember(engine, task)  # warm: the first run's steps are slower
    original = engine.add_request

    def add_request(prompt, params, **kw):
        add_request.calls += 1
        params = dataclasses.replace(params, ignore_eos=True,
                                     max_tokens=4 if add_request.calls == 1 else 40)
        return original(prompt, params, **kw)
    add_request.calls = 0
    engine.add_request = add_request
    out = run_ember(engine, task)
    seconds = out["tokens"] / out["tok_s"]
    assert out["tokens"] == 44
    assert 0.5 * seconds <= out["mean_latency_s"] < 0.8 * seconds
