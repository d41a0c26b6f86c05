"""Verification: what a step's sampled rows need between the logits and the commit.

A row that samples — a plain decode row, or one that verifies a draft — is sampled
position by position on the hypothetical prefix its draft makes, through the request's
processors (which look ahead and roll back); the recycling tables get a few rows'
top-k; the draft sources learn what was accepted (the commit tells them). Prompt
logprobs are read from the raw distribution. The engine runs these in
:meth:`LLMEngine._verify`; nothing here writes a request's progress.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ember.engine.request import Request
from ember.engine.runner import ScheduledRow
from ember.errors import NonFiniteLogits
from ember.sampling.sampler import TokenLogprobs
from ember.spec.speculator import TOPK

FEED_ROWS = 4  # requests per step whose verification logits feed the recycling tables
# While the gate grants no draft (a batch whose steps are compute-bound: only
# near-certain drafts pay, and recycled ones never are), the tables are fed only every
# this many steps, from one request at a time: the feed (a top-k over the vocabulary
# and the table updates, ~0.2 ms a row here) cost SmolLM2 at 16 streams ~5% of its
# throughput for drafts nobody could take.
IDLE_FEED_EVERY = 16


def finite_rows(rows: list[ScheduledRow], logits: torch.Tensor,
                fail: Callable[[Request, Exception], None]
                ) -> tuple[list[ScheduledRow], torch.Tensor, list[Request]]:
    """The rows whose logits are all finite, and their logits; a row given a NaN or an
    infinity fails alone (``fail``: its request ends with an error that says so, its
    cache rewound) while the step's other rows go on. Returns those failed too."""
    finite = torch.isfinite(logits).all(dim=-1)
    if bool(finite.all()):
        return rows, logits, []
    kept, index, failed, offset = [], [], [], 0
    for row in rows:
        n = row.num_logits
        if bool(finite[offset:offset + n].all()):
            kept.append(row)
            index += range(offset, offset + n)
        else:
            fail(row.request, NonFiniteLogits(
                "the model's logits for this request came out non-finite (NaN or "
                "infinity): no token can be drawn from them"))
            failed.append(row.request)
        offset += n
    return kept, logits[torch.tensor(index, dtype=torch.long)], failed


def processed(req: Request, row_logits: torch.Tensor, draft: list[int]
               ) -> list[torch.Tensor | None]:
    """Each verify row after the request's processors, positioned for that row: the
    processors look ahead through the draft tokens before it, then roll back."""
    sampler = req.sampler
    if not sampler.processors:
        return [None] * (len(draft) + 1)
    out, ahead = [], 0
    try:
        for j in range(len(draft) + 1):
            out.append(sampler.process(row_logits[j], [*req.token_ids, *draft[:j]]))
            if j < len(draft):
                for proc in sampler.processors:
                    proc.lookahead(draft[j])  # type: ignore[attr-defined]
                ahead += 1
    finally:
        for proc in sampler.processors:
            if ahead:
                proc.rollback(ahead)  # type: ignore[attr-defined]
    return out


def stacked(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows' logits as one tensor: a view when they are consecutive rows of one
    tensor (every row samples and none asks for prompt logprobs: the usual step), so
    a step does not copy its [rows, vocab] logits; else a concatenated copy."""
    if not parts:
        return None
    first, width = parts[0], parts[0].shape[-1]
    n = sum(p.shape[0] for p in parts)
    consecutive = all(p.dim() == 2 and p.stride() == (width, 1) for p in parts) and all(
        b.data_ptr() == a.data_ptr() + a.shape[0] * width * a.element_size()
        for a, b in zip(parts, parts[1:], strict=False))
    if consecutive and first.untyped_storage().nbytes() >= (
            first.storage_offset() + n * width) * first.element_size():
        return first.as_strided((n, width), (width, 1))
    return torch.cat(parts)


def recycling_feed(plans: list[tuple[ScheduledRow, torch.Tensor, int]],
                   raw: torch.Tensor | None, turn: int, rows: int = FEED_ROWS
                   ) -> dict[Request, torch.Tensor]:
    """Top-k rows for the recycling tables, from at most ``rows`` requests (the
    ``turn``-th feed's share, so requests take turns): a table of successors fills as
    well from a few streams, and a top-k over every row of a full batch would cost more
    than its drafts win."""
    wanting = [(row, start) for row, _, start in plans
               if row.request.speculator is not None and row.request.speculator.wants_topk]
    if raw is None or not wanting:
        return {}
    if len(wanting) > rows:
        first = turn * rows % len(wanting)
        wanting = (wanting + wanting)[first:first + rows]
    index = torch.cat([torch.arange(start, start + len(row.draft) + 1)
                       for row, start in wanting])
    topk = raw.index_select(0, index).topk(TOPK).indices
    out, at = {}, 0
    for row, _ in wanting:
        n = len(row.draft) + 1
        out[row.request] = topk[at:at + n]
        at += n
    return out


def feed_speculator(row: ScheduledRow, committed: list[int], topk: torch.Tensor | None
                     ) -> None:
    """Tell a speculating request's draft sources what was committed: the tokens, the
    verification's top-k (recycling) and how much of its draft was accepted."""
    spec = row.request.speculator
    if spec is None:
        return
    spec.observe(committed)
    if spec.wants_topk and topk is not None:
        history = row.request.token_ids
        inputs = [history[len(history) - len(committed) - 1], *row.draft][:len(committed)]
        spec.observe_topk(inputs, topk[:len(committed)])
    if row.draft and row.proposal is not None:
        accepted = 0
        while (accepted < min(len(committed), len(row.draft))
               and committed[accepted] == row.draft[accepted]):
            accepted += 1
        spec.feedback(row.proposal, len(row.draft), accepted,
                      bonus=len(committed) == len(row.draft) + 1)


def prompt_logprobs_of(row: ScheduledRow, logits: torch.Tensor) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens after ``row.prompt_positions``, from the model's
    raw distribution (no sampling parameters apply to a prompt); the commit records
    them."""
    req, n_top = row.request, row.request.params.prompt_logprobs or 0
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    following = torch.tensor([req.prompt_ids[p + 1] for p in row.prompt_positions])
    chosen = logprobs.gather(1, following[:, None])[:, 0].tolist()
    top = logprobs.topk(n_top) if n_top else None
    out = []
    for i, token in enumerate(following.tolist()):
        alternatives = (list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
                        if top is not None else [])
        out.append(TokenLogprobs(token, chosen[i], alternatives))
    return out
