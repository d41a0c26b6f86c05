"""The one sampling seam every decode path goes through.

Pipeline, in this order: logit processors (grammar masks) → repetition / presence /
frequency penalties → greedy shortcut → top-k → temperature → top-p → min-p → draw.

Contract: exactly one draw from the request's own seeded generator per committed
token, greedy included (its draw is discarded). The token is chosen by inverse-CDF
on that single uniform, so a request's output depends on its seed and its logits
alone — never on batch composition, and a speculative path that verifies several
tokens can reproduce the same draws in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ember.sampling.params import SamplingParams


@runtime_checkable
class LogitProcessor(Protocol):
    """Masks or reshapes a logits row before the rest of the pipeline."""

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor: ...

    def commit(self, token: int) -> None:
        """Observe the committed token; called exactly once per sampled token."""
        ...


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), most likely first


class Sampler:
    """Per-request sampling state: parameters, generator, penalty counts, processors."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt: Sequence[int] = (),
        processors: Sequence[LogitProcessor] = (),
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.processors = list(processors)
        self.generator = torch.Generator()
        seed = params.seed if params.seed is not None else torch.seed()
        self.generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        self._penalized = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        if self._penalized:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool)
            self._seen[torch.as_tensor(list(prompt), dtype=torch.long)] = True
            self._output_counts = torch.zeros(vocab_size, dtype=torch.float32)

    def sample(
        self, logits: torch.Tensor, history: Sequence[int] = ()
    ) -> tuple[int, TokenLogprobs | None]:
        """Choose the next token from one logits row (vocab,) and commit it."""
        logits = logits[: self.vocab_size].float()
        raw = logits
        for proc in self.processors:
            logits = proc.process(logits, history)
        if self._penalized:
            logits = self._apply_penalties(logits)
        u = float(torch.rand((), generator=self.generator))  # the one draw per token
        token = int(logits.argmax()) if self.params.greedy else self._draw(logits, u)
        self.commit(token)
        return token, self._logprobs(raw, token)

    def commit(self, token: int) -> None:
        for proc in self.processors:
            proc.commit(token)
        if self._penalized:
            self._seen[token] = True
            self._output_counts[token] += 1

    def _apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        logits = logits.clone()
        if p.repetition_penalty != 1.0:
            seen = self._seen
            logits[seen] = torch.where(
                logits[seen] > 0, logits[seen] / p.repetition_penalty,
                logits[seen] * p.repetition_penalty,
            )
        counts = self._output_counts
        if p.frequency_penalty:
            logits -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits -= p.presence_penalty * (counts > 0).float()
        return logits

    def _draw(self, logits: torch.Tensor, u: float) -> int:
        p = self.params
        if 0 < p.top_k < logits.numel():
            values, order = logits.topk(p.top_k)  # sorted; far cheaper than a full sort
        else:
            values, order = logits.sort(descending=True)
        probs = torch.softmax(values / p.temperature, dim=-1)
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least one)
            before = probs.cumsum(0) - probs
            probs = probs.masked_fill(before >= p.top_p, 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs[0], 0.0)
        cdf = probs.cumsum(0)
        idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True))
        return int(order[min(idx, order.numel() - 1)])

    def _logprobs(self, raw: torch.Tensor, token: int) -> TokenLogprobs | None:
        n = self.params.logprobs
        if n is None:
            return None
        lp = torch.log_softmax(raw, dim=-1)
        top = lp.topk(n) if n else None
        pairs = [(int(i), float(v)) for v, i in zip(*top, strict=True)] if top else []
        return TokenLogprobs(token, float(lp[token]), pairs)
