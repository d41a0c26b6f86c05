"""The sampling pipeline against a direct numpy computation of each filter.

For a logits row and a uniform u, the sampler must pick exactly the token numpy's
inverse CDF picks on the distribution the documented pipeline defines (processors →
penalties → greedy → top-k → temperature → top-p → min-p → draw, tokens in vocabulary
order). Checking a grid of u values checks the whole distribution, deterministically.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.sampling import sampler as S
from ember.sampling.params import SamplingParams

V = 40


def reference_probs(logits: np.ndarray, p: SamplingParams, seen: np.ndarray | None = None,
                    counts: np.ndarray | None = None) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    if seen is not None:
        r = p.repetition_penalty
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if 0 < p.top_k < V:
        kth = np.sort(x)[::-1][p.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    z = x / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(V, bool)
        keep[order[before < p.top_p]] = True
        probs = np.where(keep, probs, 0)
    if p.min_p > 0:
        probs = np.where(probs < p.min_p * probs.max(), 0, probs)
    return probs / probs.sum()


def reference_pick(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), V - 1))


def pick(logits: torch.Tensor, params: SamplingParams, u: float, prompt=()) -> int:
    sampler = S.Sampler(params, V, prompt)
    original = S.draw
    try:
        S.draw = lambda seed, position: u
        return S.sample_rows([S.SampleRow(sampler, logits, None, (), 0)])[0][0]
    finally:
        S.draw = original


LOGITS = torch.tensor(np.random.default_rng(0).normal(0, 2, V), dtype=torch.float32)
GRID = [i / 97 + 0.003 for i in range(97)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.6),
    SamplingParams(temperature=1.2, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.8, min_p=0.05),
], ids=["t1", "t0.5", "topk", "topp", "minp", "all"])
def test_each_filter_draws_exactly_the_numpy_distribution(params):
    probs = reference_probs(LOGITS.numpy(), params)
    for u in GRID:
        assert pick(LOGITS, params, u) == reference_pick(probs, u), u


def test_penalties_count_the_prompt_and_the_output():
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.7,
                            frequency_penalty=0.4)
    prompt = [3, 7, 7, 11]
    sampler = S.Sampler(params, V, prompt)
    for t in (5, 5, 9):
        sampler.commit(t)
    seen = np.zeros(V, bool)
    seen[[3, 7, 11, 5, 9]] = True
    counts = np.zeros(V)
    counts[5], counts[9] = 2, 1  # output only: frequency/presence follow OpenAI
    probs = reference_probs(LOGITS.numpy(), params, seen, counts)
    original = S.draw
    try:
        for u in GRID:
            S.draw = lambda seed, position, u=u: u
            got = S.sample_rows([S.SampleRow(sampler, LOGITS, None, (), 0)])[0][0]
            assert got == reference_pick(probs, u)
    finally:
        S.draw = original


def test_assumed_draft_tokens_count_as_committed_for_penalties():
    params = SamplingParams(temperature=1.0, frequency_penalty=1.5)
    plain = S.Sampler(params, V)
    plain.commit(4)
    plain.commit(6)
    ahead = S.Sampler(params, V)
    ahead.commit(4)
    for u in GRID:
        original = S.draw
        try:
            S.draw = lambda seed, position, u=u: u
            a = S.sample_rows([S.SampleRow(plain, LOGITS, None, (), 0)])[0][0]
            b = S.sample_rows([S.SampleRow(ahead, LOGITS, None, (6,), 0)])[0][0]
        finally:
            S.draw = original
        assert a == b


class _Ban:
    """A processor that masks one token out (as a grammar would)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def process(self, logits: torch.Tensor, history) -> torch.Tensor:
        out = logits.clone()
        out[self.token] = float("-inf")
        return out

    def commit(self, token: int) -> None:
        pass


def test_greedy_is_the_argmax_after_processors_and_penalties():
    """The processor bans the raw argmax; the penalty then demotes the second (it is in
    the prompt), so only a pipeline that applies both picks the third."""
    order = LOGITS.argsort(descending=True).tolist()
    first, second = order[0], order[1]
    params = SamplingParams(temperature=0, repetition_penalty=9.0)
    sampler = S.Sampler(params, V, [second], [_Ban(first)])
    processed = sampler.process(LOGITS, [second])
    got = S.sample_rows([S.SampleRow(sampler, LOGITS, processed, (), 0)])[0][0]
    expect = LOGITS.clone()
    expect[first] = float("-inf")
    expect[second] = expect[second] / 9.0 if expect[second] > 0 else expect[second] * 9.0
    assert got == int(expect.argmax())
    assert got not in (first, second)


def test_pipeline_order_top_k_before_temperature_before_top_p():
    # with these logits, top-p after a temperature keeps a different set than before it
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0] + [-9.0] * (V - 4))
    params = SamplingParams(temperature=0.2, top_k=3, top_p=0.5)
    probs = reference_probs(logits.numpy(), params)
    assert (probs > 0).sum() == 1  # sharpened first, so top-p keeps one token
    for u in GRID:
        assert pick(logits, params, u) == reference_pick(probs, u)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    rng = np.random.default_rng(1)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s)
              for t, k, p, s in [(0.7, 0, 1.0, 1), (1.3, 8, 0.9, 2), (0, 0, 1.0, 3),
                                 (1.0, 0, 0.5, 4)]]
    rows = [S.SampleRow(S.Sampler(p, V), torch.tensor(rng.normal(0, 2, V),
                                                      dtype=torch.float32), None, (), i)
            for i, p in enumerate(params)]
    together = [t for t, _ in S.sample_rows(rows)]
    alone = [S.sample_rows([r])[0][0] for r in rows]
    assert together == alone


def test_draws_are_a_pure_function_of_seed_and_position():
    assert S.draw(7, 3) == S.draw(7, 3)
    assert len({S.draw(7, i) for i in range(1000)}) == 1000
    assert S.draw(7, 0) != S.draw(8, 0)
    us = np.array([S.draw(12345, i) for i in range(20000)])
    assert 0 <= us.min() and us.max() < 1
    hist = np.histogram(us, bins=10, range=(0, 1))[0]
    assert hist.min() > 1800 and hist.max() < 2200  # uniform (±10% per decile)


def test_the_committed_token_at_position_i_uses_draw_i():
    sampler = S.Sampler(SamplingParams(temperature=1.0, seed=99), V)
    probs = reference_probs(LOGITS.numpy(), sampler.params)
    for i in (0, 1, 17, 400):
        token, _ = sampler.pick(LOGITS, [], i)
        assert token == reference_pick(probs, S.draw(99, i))
