"""A request's state: its committed tokens, its KV blocks, its sampler and its text.

Invariant (DESIGN.md): once a request is decoding, ``len(token_ids) == kv_len + 1``
— the newest committed token is not yet in the cache. While its prompt is being
prefilled, ``kv_len < len(token_ids) - 1``. ``num_computed`` is kept equal to the
block table's ``kv_len``; every error path restores this by truncating.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ember.errors import InvalidDecodeState
from ember.kv.blocks import BlockTable
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import Sampler, TokenLogprobs
from ember.spec.speculator import Speculator
from ember.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # end-of-generation token or stop string / stop token id
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # a step failed for this request
    REJECTED = "rejected"  # refused before its first token: it would miss its TTFT objective


@dataclass(eq=False)  # identity semantics: requests are hashable and unique
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    block_table: BlockTable
    detokenizer: IncrementalDetokenizer
    eos_ids: frozenset[int]
    max_total_tokens: int  # context window: prompt + output may not exceed it
    salt: bytes = b""
    tenant: str = ""  # whose request it is: prefix-cache scope and fair-share account
    priority: int = 0  # lower is served first
    weight: float = 1.0  # the tenant's share of the step budget, relative to others
    slo_ttft: float | None = None  # seconds to the first token it asks for
    slo_tpot: float | None = None  # seconds per output token it asks for
    token_ids: list[int] = field(default_factory=list)
    # chain keys of the history's full blocks, hashed once (the KV manager's cache)
    block_hashes: list[bytes] = field(default_factory=list)
    # siblings (n > 1) that start from this request's prompt once it is computed
    forks: list[Request] = field(default_factory=list)
    speculator: Speculator | None = None  # its draft sources, when it speculates
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_param: str | None = None  # the request parameter that caused ``error``, if any
    cached_tokens: int = 0
    text: str = ""  # full output text (stop string excluded once found)
    emitted_chars: int = 0  # how much of ``text`` has been streamed out
    streamed_tokens: int = 0  # how many output tokens have been streamed out
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs: one per prompt token, None for the first (no context)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None  # first admission (queue time ends here)
    first_token_time: float | None = None
    retry_after: float | None = None  # when rejected: seconds until it would fit
    admitted_seq: int = 0  # admission order, for preemption (latest goes first)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    # ------------------------------------------------------------ accessors
    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed (the prefix cache has no logits:
        such a request computes its prompt itself)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def kv_len(self) -> int:
        return self.block_table.kv_len

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to run before the next sample (1 when decoding)."""
        return len(self.token_ids) - self.kv_len

    def check_invariant(self) -> None:
        """Right after a token is committed, exactly that token is not yet cached."""
        if len(self.token_ids) != self.kv_len + 1:
            raise InvalidDecodeState(
                f"request {self.request_id}: history {len(self.token_ids)} != "
                f"kv_len {self.kv_len} + 1"
            )

    # ------------------------------------------------------------ updates
    def append_token(self, token: int, logprobs: TokenLogprobs | None) -> None:
        """Commit one sampled token: extend history and text, then check stops."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            self.text += self.detokenizer.flush()
            self.finish(FinishReason.STOP)
            return
        self.text += self.detokenizer.push(token)
        if p.stop and self._cut_at_stop_string():
            self.finish(FinishReason.STOP)
        elif (p.max_tokens is not None and self.num_output >= p.max_tokens) or len(
            self.token_ids
        ) >= self.max_total_tokens:
            self.text += self.detokenizer.flush()
            self.finish(FinishReason.LENGTH)

    def _cut_at_stop_string(self) -> bool:
        # Only the tail that could contain a newly completed stop string is searched.
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, self.emitted_chars - longest)
        hits = [i for s in self.params.stop if (i := self.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def take_delta(self) -> str:
        """Text that is safe to stream now.

        While stop strings are set, a tail that is a prefix of one of them is held
        back until it either completes the stop string or turns out not to.
        """
        end = len(self.text)
        if self.params.stop and not self.is_finished:
            end -= _held_back(self.text, self.params.stop)
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = max(self.emitted_chars, end)
        return delta

    @property
    def group_size(self) -> int:
        """Sequences this request occupies once admitted: itself and its forks."""
        return 1 + len(self.forks)

    def finish(self, reason: FinishReason, error: str | None = None,
               param: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.error_param = param


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
