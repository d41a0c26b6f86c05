"""Prompt logprobs (``SamplingParams.prompt_logprobs``, the server's ``echo``): each
prompt token's logprob under the model given the tokens before it, computed in the
prefill forward pass. The oracle is teacher forcing: ``model.score`` runs the whole
prompt as one sequence in a private KV pool, whatever the engine's chunking, batching,
preemption or prefix cache did."""

from __future__ import annotations

import pytest
import torch
from test_engine import prompts, run

from ember.sampling.params import InvalidSamplingParams, SamplingParams


def teacher_forced(model, prompt: list[int], n_top: int, kv_dtype: str
                   ) -> list[tuple[float, list]]:
    logprobs = torch.log_softmax(model.score(prompt, kv_dtype=kv_dtype).float(), dim=-1)
    out = []
    for i in range(1, len(prompt)):
        top = logprobs[i - 1].topk(n_top) if n_top else None
        out.append((float(logprobs[i - 1, prompt[i]]),
                    [] if top is None else top.indices.tolist()))
    return out


def check(model, prompt: list[int], got, n_top: int, kv_dtype: str) -> None:
    """``got`` against teacher forcing with the engine's KV dtype."""
    assert got[0] is None and len(got) == len(prompt)
    want = teacher_forced(model, prompt, n_top, kv_dtype)
    for i, (lp, (value, top)) in enumerate(zip(got[1:], want, strict=True), start=1):
        assert lp.token == prompt[i]
        assert lp.logprob == pytest.approx(value, abs=1e-4), i
        assert [t for t, _ in lp.top] == top or n_top == 0
        assert len(lp.top) == n_top


def test_prompt_logprobs_equal_teacher_forcing_chunked_batched_and_preempted(
        make_tiny_engine, tiny_loaded):
    ps = prompts(6, seed=5, lo=20, hi=60)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                             prompt_logprobs=i % 3) for i in range(len(ps))]
    # small steps and a small pool: prompts are chunked and requests preempted
    engine = make_tiny_engine(num_kv_blocks=12, block_size=8, max_num_batched_tokens=24)
    outs = run(engine, list(zip(ps, params, strict=True)))
    assert engine.scheduler.num_preemptions > 0
    for p, sp, out in zip(ps, params, outs, strict=True):
        check(tiny_loaded.model, p, out.prompt_logprobs, sp.prompt_logprobs, engine.config.kv_dtype)
        assert len(out.token_ids) == 4
    engine.kv.check_no_leaks()


def test_a_cached_prefix_is_recomputed_for_its_logprobs(make_tiny_engine, tiny_loaded):
    prompt = prompts(1, seed=9, lo=40, hi=41)[0]
    engine = make_tiny_engine(block_size=8)
    run(engine, [(prompt, SamplingParams(max_tokens=1))])  # caches the prompt's blocks
    out = run(engine, [(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))])[0]
    assert out.cached_tokens == 0
    check(tiny_loaded.model, prompt, out.prompt_logprobs, 1, engine.config.kv_dtype)
    again = run(engine, [(prompt, SamplingParams(max_tokens=1))])[0]
    assert again.cached_tokens > 0  # without prompt logprobs the cache still serves


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(make_tiny_engine,
                                                                 tiny_loaded):
    prompt = prompts(1, seed=2, lo=30, hi=31)[0]
    engine = make_tiny_engine()
    out = run(engine, [(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))])[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    check(tiny_loaded.model, prompt, out.prompt_logprobs, 0, engine.config.kv_dtype)
    engine.kv.check_no_leaks()


def test_n_siblings_share_the_prompt_logprobs(make_tiny_engine, tiny_loaded):
    prompt = prompts(1, seed=4, lo=25, hi=26)[0]
    engine = make_tiny_engine()
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, prompt_logprobs=2)
              for s in range(3)]
    group = engine.add_group(prompt, params)
    while engine.has_unfinished():
        engine.step()
    outs = [engine.output(r) for r in group]
    for out in outs:
        check(tiny_loaded.model, prompt, out.prompt_logprobs, 2, engine.config.kv_dtype)


def test_prompt_logprobs_must_be_0_to_20():
    with pytest.raises(InvalidSamplingParams, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
