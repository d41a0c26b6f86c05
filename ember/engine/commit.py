"""The commit: the one writer of a request's progress once it is admitted.

Progress is a request's history (``token_ids`` and their logprobs), the positions
of it whose K/V are cached (``kv_len``, with its full blocks registered in the
prefix cache), its text and its end (``finish``). The engine hands each step's
results here; nothing else writes them. The KV manager's ``admit``, ``fork``,
``truncate`` and ``free`` place and release a request's blocks; they are the only
other writers of KV state.

The invariant (docs/architecture.md) after every commit of a sampled token:
``len(token_ids) == kv_len + 1`` — the newest token is not yet cached. A commit
that would break it raises :class:`~ember.errors.InvalidDecodeState`: an engine
bug, never one request's failure.
"""

from __future__ import annotations

import logging
import time

import torch

from ember.engine.request import FinishReason, Request, RequestStatus
from ember.engine.runner import ScheduledRow
from ember.engine.verify import feed_speculator
from ember.errors import InvalidDecodeState
from ember.kv.manager import KVCacheManager
from ember.sampling.sampler import TokenLogprobs

log = logging.getLogger("ember.engine")


def finish(req: Request, reason: FinishReason, error: str | None = None,
           param: str | None = None) -> None:
    """End a request (its blocks are released when the engine retires it)."""
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason
    req.error = error
    req.error_param = param


class Commit:
    """Advances requests after a forward pass; counts the tokens it commits."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def computed(self, row: ScheduledRow) -> None:
        """A row that samples nothing: its history positions are now cached."""
        self._count_prompt(row)
        self._cached(row.request, row.start + row.num_tokens)

    def prompt_only(self, row: ScheduledRow) -> None:
        """A row that reached the end of a prompt whose request asked for no tokens."""
        self.computed(row)
        finish(row.request, FinishReason.LENGTH)

    def prompt_logprobs(self, row: ScheduledRow, logprobs: list[TokenLogprobs]) -> None:
        """The logprobs of the prompt tokens after the row's prompt positions."""
        row.request.prompt_logprobs.extend(logprobs)

    def sampled(self, row: ScheduledRow, results: list[tuple[int, TokenLogprobs | None]],
                topk: torch.Tensor | None = None) -> list[int]:
        """Commit a row's sampled tokens: while they equal its draft, then the first that
        differs (the correction) or, after a fully accepted draft, the bonus; a token
        that ends the request ends the commit. The history and the accepted drafts are
        cached; the KV of rejected draft positions is dropped; the request's draft
        sources learn what was committed (``topk``: the verification's, for recycling).
        Returns the tokens."""
        self._count_prompt(row)
        req, draft = row.request, row.draft
        committed: list[int] = []
        for j, (token, lp) in enumerate(results):
            req.sampler.commit(token)
            self._append(req, token, lp)
            committed.append(token)
            if req.is_finished or j == len(draft) or token != draft[j]:
                break
        # everything before the newest committed token: the row's history and the
        # drafts it accepted — but a hybrid model's recurrent state (its KV holds state
        # slots) took every draft token: it goes back to its snapshot after the history
        # and the accepted drafts run again
        replay = 0
        if self.kv.state_slots and len(committed) <= len(draft) and not req.is_finished:
            replay = len(committed) - 1
        self._cached(req, row.start + row.num_tokens + len(committed) - 1 - replay)
        self.kv.trim(req)
        req.check_invariant(uncomputed=1 + replay)
        self.generation_tokens += len(committed)
        feed_speculator(row, committed, topk)
        return committed

    def first_token(self, req: Request, parent: Request, token: int,
                    lp: TokenLogprobs | None) -> None:
        """A forked sibling's first token, sampled from its parent's logits row: its
        processors advance, it takes the parent's prompt logprobs (the same prompt), and
        its draft sources learn the token."""
        req.sampler.commit(token)
        if parent.params.prompt_logprobs is not None:
            req.prompt_logprobs = list(parent.prompt_logprobs)
        self._append(req, token, lp)
        req.check_invariant()
        self.generation_tokens += 1
        if req.speculator is not None:
            req.speculator.observe([token])

    def fail(self, req: Request, e: Exception) -> None:
        """End one request with an error, its cache rewound to its committed history.
        ``e.param``, where set, names the request parameter at fault."""
        param = getattr(e, "param", None)
        log.log(logging.INFO if param else logging.WARNING, "request %s failed: %s",
                req.request_id, e)
        self.kv.truncate(req, len(req.token_ids) - 1)
        finish(req, FinishReason.ERROR, str(e), param)

    # ------------------------------------------------------------ internals
    def _count_prompt(self, row: ScheduledRow) -> None:
        if not row.request.num_output:
            self.prompt_tokens += row.num_tokens

    def _cached(self, req: Request, kv_len: int) -> None:
        if kv_len < req.kv_len:
            raise InvalidDecodeState(f"request {req.request_id}: the cache would move "
                                     f"back from {req.kv_len} to {kv_len} positions")
        req.block_table.kv_len = kv_len
        self.kv.register_computed(req)

    def _append(self, req: Request, token: int, lp: TokenLogprobs | None) -> None:
        """Extend the history and the text by one token, and end the request at a stop."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.token_ids.append(token)
        if lp is not None:
            req.logprobs.append(lp)
        reason = _stop_after(req, token)
        if reason is not None:
            finish(req, reason)


def _stop_after(req: Request, token: int) -> FinishReason | None:
    """Add the token's text; the reason the request ends with it, if it does."""
    stops = req.stops
    if token in stops.token_ids:
        req.text += req.detokenizer.flush()
        return FinishReason.STOP
    req.text += req.detokenizer.push(token)
    cut = stops.cut(req.text, req.emitted_chars)
    if cut is not None:
        req.text, req.stop_string = req.text[:cut[0]], cut[1]
        return FinishReason.STOP
    if stops.at_length(req.num_output, len(req.token_ids)):
        req.text += req.detokenizer.flush()
        return FinishReason.LENGTH
    return None
