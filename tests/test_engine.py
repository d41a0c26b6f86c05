"""Engine behaviour on the tiny model: lossless batching, chunking, preemption, reuse."""

from __future__ import annotations

import random

import pytest
import torch

from ember.config import InvalidConfig
from ember.engine.admission import QueueFull
from ember.engine.engine import LLMEngine
from ember.engine.intake import InvalidRequest
from ember.engine.output import RequestOutput
from ember.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=12,
                          ignore_eos=True, logprobs=2)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run(engine: LLMEngine, reqs: list[tuple[list[int], SamplingParams]], tenant: str | None = None,
        check=None) -> list[RequestOutput]:
    ids = [engine.add_request(p, sp, tenant=tenant).request_id for p, sp in reqs]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            check(engine)
    return [done[i] for i in ids]


def outcome(out: RequestOutput, weights: str = "f32") -> list[int] | tuple[list[int], list]:
    """What must not change: the tokens, and with q4 also every logprob (and the top 2)
    to the bit. (f32's attention is PyTorch's, whose float sums depend on the batch's
    shape by ~1e-7: its tokens are compared.)"""
    if weights == "f32":
        return out.token_ids
    return out.token_ids, [(lp.token, lp.logprob, lp.top) for lp in out.logprobs or []]


def alone(make, prompt: list[int], params: SamplingParams, weights: str = "f32", **options):
    return outcome(run(make(weights=weights, **options), [(prompt, params)])[0], weights)


# The lossless properties hold for f32 (tokens) and for q4 (tokens and logprobs, to the
# bit: the fused native stack computes every token on its own, ember/kernels/fused_decoder.h).
WEIGHTS = pytest.mark.parametrize("weights", ["f32", "q4"])


@WEIGHTS
@pytest.mark.parametrize("params_of", [lambda i: GREEDY, sampled], ids=["greedy", "seeded"])
def test_request_alone_equals_batch_of_16_mixed_lengths(make_tiny_engine, params_of, weights):
    ps = prompts(16, seed=1)
    expected = [alone(make_tiny_engine, p, params_of(i), weights=weights)
                for i, p in enumerate(ps)]
    batched = run(make_tiny_engine(weights=weights),
                  [(p, params_of(i)) for i, p in enumerate(ps)])
    assert [outcome(o, weights) for o in batched] == expected


@WEIGHTS
def test_small_chunked_prefill_budget_changes_nothing(make_tiny_engine, weights):
    ps = prompts(6, seed=2, lo=40, hi=90)
    expected = [alone(make_tiny_engine, p, GREEDY, weights=weights) for p in ps]
    engine = make_tiny_engine(max_num_batched_tokens=7, weights=weights)
    steps = record_schedules(engine)
    outs = run(engine, [(p, GREEDY) for p in ps])
    assert [outcome(o, weights) for o in outs] == expected
    assert steps and max(sum(n for _, n in rows) for rows in steps) <= 7  # the budget held
    chunks: dict[str, list[int]] = {}
    for rows in steps:
        for rid, n in rows:
            chunks.setdefault(rid, []).append(n)
    # every prompt (40-89 tokens) was prefilled in budget-sized pieces, in order
    for (rid, got), prompt in zip(sorted(chunks.items(), key=lambda kv: int(kv[0][4:])), ps,
                                  strict=True):
        prefill = []
        for n in got:
            prefill.append(n)
            if sum(prefill) == len(prompt):
                break
        assert sum(prefill) == len(prompt) and len(prefill) >= -(-len(prompt) // 7), (rid, got)


def record_schedules(engine: LLMEngine) -> list[list[tuple[str, int]]]:
    """Record each step's rows as (request id, tokens) pairs."""
    steps: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording(proposals=None):
        out = schedule(proposals)
        steps.append([(r.request.request_id, r.num_tokens) for r in out.rows])
        return out

    engine.scheduler.schedule = recording
    return steps


@WEIGHTS
def test_preempted_and_resumed_request_is_unchanged(make_tiny_engine, weights):
    ps = prompts(8, seed=3, lo=20, hi=40)
    params = [sampled(i) for i in range(8)]
    expected = [alone(make_tiny_engine, p, sp, weights=weights)
                for p, sp in zip(ps, params, strict=True)]
    # 10 blocks of 16 slots cannot hold 8 requests of up to 52 tokens at once.
    engine = make_tiny_engine(num_kv_blocks=10, block_size=16, enable_prefix_caching=False,
                              weights=weights)
    outs = run(engine, list(zip(ps, params, strict=True)))
    assert engine.scheduler.num_preemptions > 0
    assert [outcome(o, weights) for o in outs] == expected
    engine.kv.check_no_leaks()


@WEIGHTS
def test_prefix_served_from_cache_gives_same_output_and_counts_tokens(make_tiny_engine, weights):
    engine = make_tiny_engine(block_size=16, weights=weights)
    prompt = prompts(1, seed=4, lo=100, hi=101)[0]
    first = run(engine, [(prompt, GREEDY)])[0]
    second = run(engine, [(prompt, GREEDY)])[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96  # 6 full blocks; the last prompt token is recomputed
    assert outcome(second, weights) == outcome(first, weights)
    follow_up = prompt + first.token_ids + [500, 600]
    third = run(engine, [(follow_up, GREEDY)])[0]
    assert third.cached_tokens >= 96
    assert outcome(third, weights) == alone(make_tiny_engine, follow_up, GREEDY, weights=weights)


def test_tenants_never_share_prefix_cache(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = prompts(1, seed=5, lo=80, hi=81)[0]
    run(engine, [(prompt, GREEDY)], tenant="alice")
    assert run(engine, [(prompt, GREEDY)], tenant="bob")[0].cached_tokens == 0
    assert run(engine, [(prompt, GREEDY)], tenant="alice")[0].cached_tokens == 64


def test_prefix_hit_with_colliding_hash_is_refused(make_tiny_engine, monkeypatch):
    """A hash collision must cost a miss, never serve another prompt's cache."""
    import ember.kv.prefix as prefix

    monkeypatch.setattr(prefix, "chain_key", lambda parent, tokens: b"same-key")
    engine = make_tiny_engine()
    a, b = prompts(2, seed=6, lo=40, hi=41)
    run(engine, [(a, GREEDY)])
    out = run(engine, [(b, GREEDY)])[0]
    assert out.cached_tokens == 0
    assert outcome(out) == alone(make_tiny_engine, b, GREEDY)


def test_colliding_hash_never_serves_one_tenants_prefix_to_another(make_tiny_engine,
                                                                   monkeypatch):
    """Keys that ignore the chain (so the salt) collide across tenants for equal
    tokens: the hit must still verify the chain's identity, salt included."""
    import ember.kv.prefix as prefix

    monkeypatch.setattr(prefix, "chain_key",
                        lambda parent, tokens: bytes(str(list(tokens)), "ascii"))
    engine = make_tiny_engine()
    prompt = prompts(1, seed=9, lo=60, hi=61)[0]
    run(engine, [(prompt, GREEDY)], tenant="alice")
    again = run(engine, [(prompt, GREEDY)], tenant="alice")[0]
    assert again.cached_tokens == 48  # alice's own blocks are still served
    other = run(engine, [(prompt, GREEDY)], tenant="bob")[0]
    assert other.cached_tokens == 0
    engine.kv.check_no_leaks()


def test_full_queue_raises_queue_full(make_tiny_engine):
    engine = make_tiny_engine(max_queue=2)
    engine.add_request([5, 6, 7], GREEDY)
    engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(QueueFull):
        engine.add_request([5, 6, 7], GREEDY)


def test_abort_frees_blocks_at_next_step(make_tiny_engine):
    engine = make_tiny_engine(enable_prefix_caching=False)
    req = engine.add_request(prompts(1, seed=7)[0], SamplingParams(max_tokens=100, temperature=0))
    engine.step()
    engine.step()
    assert engine.kv.num_used > 0
    engine.abort(req.request_id)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert not engine.has_unfinished()
    assert engine.kv.num_used == 0
    engine.kv.check_no_leaks()


def test_bad_requests_are_rejected_with_the_parameter_named(make_tiny_engine):
    engine = make_tiny_engine(max_model_len=64)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([], GREEDY)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([1, 2, 10**9], GREEDY)
    assert "10000000" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([7] * 60, SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens" and "60" in str(e.value) and "64" in str(e.value)


@pytest.mark.parametrize("option", [{"max_num_seqs": 0}, {"block_size": 12},
                                    {"kv_cache_bytes": -1}, {"max_queue": "9"},
                                    {"kv_dtype": "f8"}, {"kv_fsync": "sometimes"},
                                    {"kv_restore": "never"}, {"kv_disk_bytes": 0},
                                    {"kv_cache_dir": "/tmp/x", "enable_prefix_caching": False}])
def test_bad_engine_options_fail_at_construction(make_tiny_engine, option):
    with pytest.raises(InvalidConfig, match=next(iter(option))):
        make_tiny_engine(**option)


def test_q8_0_kv_is_refused_at_startup_where_head_dim_is_not_whole_blocks(make_tiny_engine):
    """The tiny model's heads have 16 values; q8_0 stores rows in blocks of 32."""
    with pytest.raises(InvalidConfig, match=r"kv_dtype 'q8_0'.*head_dim 16.*multiple of 32"):
        make_tiny_engine(kv_dtype="q8_0")


class _Explodes:
    def process(self, logits, history):
        raise RuntimeError("processor exploded")

    def commit(self, token):
        pass


def test_failing_request_fails_alone_and_engine_keeps_serving(make_tiny_engine):
    engine = make_tiny_engine()
    good = engine.add_request([10, 11, 12], GREEDY)
    bad = engine.add_request([10, 11, 12], GREEDY, processors=[_Explodes()])
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[bad.request_id].finish_reason == "error"
    assert "exploded" in done[bad.request_id].error
    assert done[good.request_id].finish_reason == "length"
    engine.kv.check_no_leaks()


def test_model_failure_fails_the_step_restores_invariants_and_recovers(make_tiny_engine,
                                                                       monkeypatch):
    engine = make_tiny_engine()
    reqs = [engine.add_request(p, GREEDY) for p in prompts(3, seed=8)]
    engine.step()
    engine.step()
    real = engine.runner.model.forward
    monkeypatch.setattr(engine.runner.model, "forward",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = engine.step()
    assert {o.finish_reason for o in outs} == {"error"}
    assert all(r.is_finished for r in reqs)
    monkeypatch.setattr(engine.runner.model, "forward", real)
    engine.step()
    engine.kv.check_no_leaks()
    p = prompts(1, seed=9)[0]
    assert outcome(run(engine, [(p, GREEDY)])[0]) == alone(make_tiny_engine, p, GREEDY)


def test_stop_strings_and_stop_token_ids(make_tiny_engine):
    engine = make_tiny_engine()
    p = prompts(1, seed=10)[0]
    full = run(engine, [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])[0]
    stop_tok = full.token_ids[5]
    out = run(engine, [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                          stop_token_ids=[stop_tok]))])[0]
    first = full.token_ids.index(stop_tok)
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    # a stop string spanning a token boundary: the text is cut before it
    text = full.text
    cut = len(text) // 2
    needle = text[cut - 2 : cut + 2]
    out = run(engine, [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                          stop=[needle]))])[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(needle)]


def test_streamed_deltas_concatenate_to_the_final_text(make_tiny_engine):
    engine = make_tiny_engine()
    p = prompts(1, seed=11)[0]
    engine.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                         stop=["zzzz"]))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.delta_text)
            final = out
    assert "".join(pieces) == final.text
    assert final.completion_tokens == 20


def test_logprobs_report_the_chosen_token_and_top_alternatives(make_tiny_engine):
    engine = make_tiny_engine()
    out = run(engine, [([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4,
                                                     ignore_eos=True, logprobs=3))])[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token == tok
        assert lp.top[0][0] == tok  # greedy picks the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert torch.tensor([v for _, v in lp.top]).exp().sum() <= 1.0 + 1e-5


def test_waiting_requests_never_hold_blocks_so_admission_cannot_deadlock(make_tiny_engine):
    """Found by the property test: two preempted requests each held a cached prefix
    the other needed, and the engine waited forever. Waiting requests now hold nothing."""
    engine = make_tiny_engine(num_kv_blocks=10, block_size=4, max_num_seqs=4,
                              max_num_batched_tokens=4, max_model_len=40)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    params = SamplingParams(temperature=0.8, seed=0, ignore_eos=True, max_tokens=8)
    engine.add_request(shared + [100] * 22, params)  # 38 tokens: needs the whole pool
    engine.add_request([7], SamplingParams(temperature=0.8, seed=0, ignore_eos=True,
                                           max_tokens=5))
    for _ in range(500):
        engine.step()
        assert all(not r.block_table.blocks for r in engine.scheduler.waiting)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    engine.kv.check_no_leaks()


# ---------------------------------------------------------------- admission and aborts
def test_a_request_aborted_while_waiting_is_never_scheduled(make_tiny_engine):
    engine = make_tiny_engine()
    steps = record_schedules(engine)
    req = engine.add_request(prompts(1, seed=12)[0], GREEDY)
    engine.abort(req.request_id)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [
        (req.request_id, "abort", True)]
    assert steps == [[]] and not engine.has_unfinished()
    engine.kv.check_no_leaks()


def test_a_short_request_is_admitted_while_a_long_prompt_prefills(make_tiny_engine):
    """The long prompt's chunks are capped, so the short one gets budget at once."""
    engine = make_tiny_engine(max_num_batched_tokens=64, max_prefill_chunk=16)
    steps = record_schedules(engine)
    long = engine.add_request([5 + i % 900 for i in range(1200)], GREEDY)
    engine.step()
    short = engine.add_request([7, 8, 9, 10], GREEDY)
    engine.step()
    assert short.num_output == 1, "the short request waited behind the long prompt"
    assert long.num_output == 0 and long.kv_len > 64  # long prefill goes on, topped up
    assert sum(n for _, n in steps[-1]) == 64  # and the step still used its whole budget


def test_a_long_prompt_alone_still_gets_the_whole_budget(make_tiny_engine):
    engine = make_tiny_engine(max_num_batched_tokens=64, max_prefill_chunk=16)
    steps = record_schedules(engine)
    req = engine.add_request([5 + i % 900 for i in range(200)], GREEDY)
    engine.step()
    assert steps == [[(req.request_id, 64)]]


def test_a_waiting_request_hashes_its_prompt_once(make_tiny_engine, monkeypatch):
    """The queue's head is probed every step until it fits; its block keys are kept."""
    import ember.kv.prefix as prefix

    calls = []
    real = prefix.chain_key
    monkeypatch.setattr(prefix, "chain_key", lambda p, t: calls.append(1) or real(p, t))
    engine = make_tiny_engine(num_kv_blocks=8, block_size=16, max_num_seqs=4)
    hog = engine.add_request([3] * 100, SamplingParams(max_tokens=20, ignore_eos=True,
                                                       speculation=False))  # 1 token a step
    engine.step()  # the hog holds 7 of the 8 blocks
    engine.add_request([4] * 64, GREEDY)  # 5 blocks: waits until the hog is gone
    for _ in range(5):
        engine.step()
    assert not hog.is_finished and len(engine.scheduler.waiting) == 1
    hashed = len(calls)
    for _ in range(5):
        engine.step()
    assert len(calls) == hashed  # no re-hashing while it waits
    queries = engine.kv.prefix.queries
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.prefix.queries - queries == 63  # counted once, on admission


def test_the_grammar_compiler_is_built_once_under_concurrent_first_use(make_tiny_engine,
                                                                       monkeypatch):
    import threading
    import time as _time

    import ember.engine.intake as engine_module

    built = []

    class SlowCompiler:
        def __init__(self, tokenizer):
            _time.sleep(0.05)  # widen the window a racy lazy init would lose
            built.append(self)

    monkeypatch.setattr(engine_module, "GrammarCompiler", SlowCompiler)
    engine = make_tiny_engine()
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(engine.intake.grammars))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and all(g is built[0] for g in seen)


# ---------------------------------------------------------------- n > 1: forked choices
@pytest.mark.parametrize("prompt_len", [37, 48], ids=["partial-last-block", "full-blocks"])
def test_forked_choices_equal_their_solo_runs_and_share_the_prompt(make_tiny_engine,
                                                                   prompt_len):
    prompt = prompts(1, seed=13, lo=prompt_len, hi=prompt_len + 1)[0]
    params = [sampled(100 + j) for j in range(4)]
    expected = [alone(make_tiny_engine, prompt, p) for p in params]
    engine = make_tiny_engine(enable_prefix_caching=False)
    steps = record_schedules(engine)
    group = engine.add_group(prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [outcome(done[r.request_id]) for r in group] == expected
    assert engine.stats["prompt_tokens"] == prompt_len  # the prompt ran once, for all four
    scheduled = {rid for rows in steps for rid, _ in rows}
    assert scheduled == {r.request_id for r in group}
    engine.kv.check_no_leaks()


def test_forks_fall_back_to_their_own_prefill_when_no_block_is_free(make_tiny_engine):
    prompt = prompts(1, seed=14, lo=37, hi=38)[0]  # 3 blocks of 16, the last one partial
    params = [sampled(200 + j) for j in range(3)]
    expected = [alone(make_tiny_engine, prompt, p) for p in params]
    engine = make_tiny_engine(num_kv_blocks=4, block_size=16)
    group = engine.add_group(prompt, [replace_max(p, 8) for p in params])
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [outs[r.request_id].token_ids for r in group] == [e[:8] for e in expected]
    engine.kv.check_no_leaks()


def replace_max(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, max_tokens=max_tokens)


def test_aborting_a_pending_fork_leaves_its_siblings_running(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = prompts(1, seed=15, lo=40, hi=41)[0]
    group = engine.add_group(prompt, [sampled(1), sampled(2), sampled(3)])
    engine.abort(group[1].request_id)  # before the prompt is computed
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {group[0].request_id: "length", group[1].request_id: "abort",
                        group[2].request_id: "length"}
    engine.kv.check_no_leaks()


def test_n_larger_than_max_num_seqs_is_refused(make_tiny_engine):
    engine = make_tiny_engine(max_num_seqs=2)
    with pytest.raises(InvalidRequest) as e:
        engine.add_group([5, 6, 7], [GREEDY] * 3)
    assert e.value.param == "n"


@WEIGHTS
def test_garbage_in_never_written_kv_memory_cannot_reach_any_output(make_tiny_engine, weights):
    """The pool starts uninitialized and attention reads whole blocks: fill it with NaN
    (what reused memory can hold) and the streams must not change."""
    ps = prompts(4, seed=16, lo=5, hi=40)
    expected = [alone(make_tiny_engine, p, GREEDY, weights=weights) for p in ps]
    engine = make_tiny_engine(weights=weights)
    engine.runner.kv.pool.fill_(float("nan"))
    assert [outcome(o, weights) for o in run(engine, [(p, GREEDY) for p in ps])] == expected


def test_seats_count_the_siblings_still_to_be_forked(make_tiny_engine):
    engine = make_tiny_engine(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=16)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request([5, 6], long)
    engine.add_request([7, 8], long)
    engine.step()
    group = engine.add_group(prompts(1, seed=17, lo=60, hi=61)[0], [long, long])
    engine.step()  # the group's first chunk: seats 2 + 2 are now spoken for
    late = engine.add_request([9, 10], long)
    for _ in range(8):
        engine.step()
        assert len(engine.scheduler.running) <= 4
    assert group[1].num_output > 0 and late.num_output == 0


def test_a_forked_choice_keeps_the_copied_part_of_its_prompt_block(make_tiny_engine):
    """The partly filled last prompt block is copied into a block the child uses for
    the first time; zeroing fresh blocks must not wipe that copy afterwards."""
    engine = make_tiny_engine(enable_prefix_caching=False)
    prompt = prompts(1, seed=18, lo=37, hi=38)[0]  # 2 full blocks + 5 positions
    parent, child = engine.add_group(prompt, [sampled(1), sampled(2)])
    while parent.num_output == 0:
        engine.step()
    engine.step()  # a step after the fork: fresh blocks get zeroed here
    storage = engine.runner.kv
    p_block, c_block = parent.block_table.blocks[2], child.block_table.blocks[2]
    assert p_block != c_block
    for cache in (*storage.k, *storage.v):
        mine = cache[c_block, :5]
        assert torch.equal(mine, cache[p_block, :5])
        assert mine.abs().sum() > 0


def test_an_unattainable_tpot_objective_is_refused_naming_it(make_tiny_engine):
    """A stream whose own decode step alone outlasts its TPOT objective could never be
    seated: it is refused at once (a 400 naming slo.tpot_ms), not left waiting."""
    from ember.engine.intake import SLO

    engine = make_tiny_engine()
    with pytest.raises(InvalidRequest) as e:
        engine.prepare([5, 6, 7], GREEDY, slo=SLO(None, 1e-6))
    assert e.value.param == "slo.tpot_ms" and "cannot be met" in str(e.value)
    assert engine.prepare([5, 6, 7], GREEDY, slo=SLO(None, 10.0))  # attainable: prepared


def test_a_skewed_step_cost_fit_neither_refuses_nor_strands_requests(make_tiny_engine):
    """The live fit learns only from the steps the engine runs (a replica that only
    prefilled has never timed a decode step; a burst of load skews it). A refusal rests
    on the faster of it and the starting table, and an idle engine seats a request
    whatever the fit predicts: the steps that would correct it still run."""
    from ember.engine.costs import Coefficients
    from ember.engine.intake import SLO

    engine = make_tiny_engine()
    engine.scheduler.costs.coef = Coefficients(base=1.0)  # "a decode step takes 1 s"
    engine.scheduler.costs.learn = False  # and the fit stays that way
    slo = SLO(None, 0.15)
    ids = [engine.add_request([5, 6, 7 + i], GREEDY, slo=slo).request_id for i in range(2)]
    done = {}
    for _ in range(200):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished():
            break
    assert [done[i].finish_reason for i in ids] == ["length", "length"]
    assert len(done[ids[0]].token_ids) == GREEDY.max_tokens


def test_a_row_with_non_finite_logits_fails_alone(make_tiny_engine):
    """A step whose logits come out NaN or infinite for one request ends that request
    with an error that says so; the step's other requests commit and finish as they
    would have (the same tokens as a run without the fault); no block is leaked."""
    prompts = [[5, 9, 13, 21], [7, 11, 17], [30, 31, 32, 33, 34]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(poison: int | None) -> list:
        engine = make_tiny_engine()
        reqs = [engine.add_request(p, greedy) for p in prompts]
        execute = engine.runner.execute

        def faulty(rows):
            logits = execute(rows).clone()
            offset = 0
            for row in rows:
                if row.request is reqs[poison] and row.request.num_output == 2:
                    logits[offset + row.num_logits - 1, 3] = float("nan")
                offset += row.num_logits
            return logits

        if poison is not None:
            engine.runner.execute = faulty
        while engine.has_unfinished():
            engine.step()
        engine.kv.check_no_leaks()
        return [(r.finish_reason.value if r.finish_reason else None, r.error, r.output_ids)
                for r in reqs]

    clean, faulted = run(None), run(1)
    assert faulted[0] == clean[0] and faulted[2] == clean[2]
    reason, error, tokens = faulted[1]
    assert reason == "error" and "non-finite" in error
    assert tokens == clean[1][2][:2]  # what it had committed before the fault
