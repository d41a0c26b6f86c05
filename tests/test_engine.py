"""Engine behaviour on the tiny model: lossless batching, chunking, preemption, reuse."""

from __future__ import annotations

import random

import pytest
import torch

from ember.config import InvalidConfig
from ember.engine.engine import InvalidRequest, LLMEngine, QueueFull, RequestOutput
from ember.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=12,
                          ignore_eos=True)


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


def alone(make, prompt: list[int], params: SamplingParams) -> list[int]:
    return run(make(), [(prompt, params)])[0].token_ids


@pytest.mark.parametrize("params_of", [lambda i: GREEDY, sampled], ids=["greedy", "seeded"])
def test_request_alone_equals_batch_of_16_mixed_lengths(make_tiny_engine, params_of):
    ps = prompts(16, seed=1)
    expected = [alone(make_tiny_engine, p, params_of(i)) for i, p in enumerate(ps)]
    batched = run(make_tiny_engine(), [(p, params_of(i)) for i, p in enumerate(ps)])
    assert [o.token_ids for o in batched] == expected


def test_small_chunked_prefill_budget_changes_nothing(make_tiny_engine):
    ps = prompts(6, seed=2, lo=40, hi=90)
    expected = [alone(make_tiny_engine, p, GREEDY) for p in ps]
    engine = make_tiny_engine(max_num_batched_tokens=7)
    seen_chunks = []
    outs = run(engine, [(p, GREEDY) for p in ps],
               check=lambda e: seen_chunks.append(e.stats["steps"]))
    assert [o.token_ids for o in outs] == expected
    assert engine.stats["steps"] > 90 // 7  # prefill really was chunked


def test_preempted_and_resumed_request_is_unchanged(make_tiny_engine):
    ps = prompts(8, seed=3, lo=20, hi=40)
    params = [sampled(i) for i in range(8)]
    expected = [alone(make_tiny_engine, p, sp) for p, sp in zip(ps, params, strict=True)]
    # 12 blocks of 16 slots cannot hold 8 requests of up to 52 tokens at once.
    engine = make_tiny_engine(num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    outs = run(engine, list(zip(ps, params, strict=True)))
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    engine.kv.check_no_leaks()


def test_prefix_served_from_cache_gives_same_output_and_counts_tokens(make_tiny_engine):
    engine = make_tiny_engine(block_size=16)
    prompt = prompts(1, seed=4, lo=100, hi=101)[0]
    first = run(engine, [(prompt, GREEDY)])[0]
    second = run(engine, [(prompt, GREEDY)])[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96  # 6 full blocks; the last prompt token is recomputed
    assert second.token_ids == first.token_ids
    follow_up = prompt + first.token_ids + [500, 600]
    third = run(engine, [(follow_up, GREEDY)])[0]
    assert third.cached_tokens >= 96
    assert third.token_ids == alone(make_tiny_engine, follow_up, GREEDY)


def test_tenants_never_share_prefix_cache(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = prompts(1, seed=5, lo=80, hi=81)[0]
    run(engine, [(prompt, GREEDY)], tenant="alice")
    assert run(engine, [(prompt, GREEDY)], tenant="bob")[0].cached_tokens == 0
    assert run(engine, [(prompt, GREEDY)], tenant="alice")[0].cached_tokens == 64


def test_prefix_hit_with_colliding_hash_is_refused(make_tiny_engine, monkeypatch):
    """A hash collision must cost a miss, never serve another prompt's cache."""
    import ember.kv.manager as manager
    import ember.kv.prefix as prefix

    monkeypatch.setattr(prefix, "chain_key", lambda parent, tokens: b"same-key")
    monkeypatch.setattr(manager, "chain_key", lambda parent, tokens: b"same-key")
    engine = make_tiny_engine()
    a, b = prompts(2, seed=6, lo=40, hi=41)
    run(engine, [(a, GREEDY)])
    out = run(engine, [(b, GREEDY)])[0]
    assert out.cached_tokens == 0
    assert out.token_ids == alone(make_tiny_engine, b, GREEDY)


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
                                    {"kv_cache_bytes": -1}, {"max_queue": "9"}])
def test_bad_engine_options_fail_at_construction(make_tiny_engine, option):
    with pytest.raises(InvalidConfig, match=next(iter(option))):
        make_tiny_engine(**option)


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
    assert run(engine, [(p, GREEDY)])[0].token_ids == alone(make_tiny_engine, p, GREEDY)


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
