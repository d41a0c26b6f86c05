"""A request's state: its committed tokens, its KV blocks, its sampler and its text.

Invariant (docs/architecture.md): once a request is decoding, ``len(token_ids) == kv_len + 1``
— the newest committed token is not yet in the cache. While its prompt is being
prefilled, ``kv_len < len(token_ids) - 1``. ``kv_len`` is the block table's.

This module holds the state and reads it; after admission only
:mod:`ember.engine.commit` writes a request's progress (history, cached positions,
text, its end), and the KV manager places its blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ember.engine.stops import Stops
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


@dataclass
class Timeline:
    """When a request's work ran (``time.monotonic()``), for its trace: every step that
    computed prompt positions (a prefill chunk, or a recompute after preemption) and
    how many decode steps it took. A tuple appended per chunk: free when nobody
    traces."""

    chunks: list[tuple[float, float, int, int]] = field(default_factory=list)  # start,
    # end, first position, positions
    decode_steps: int = 0
    grammar_seconds: float = 0.0  # computing its grammar's masks
    restored_bytes: int = 0  # of its prefix, read back from the KV disk tier
    # copied from the request when it finishes
    arrival_time: float = 0.0
    admitted_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)  # identity semantics: requests are hashable and unique
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    block_table: BlockTable
    detokenizer: IncrementalDetokenizer
    stops: Stops
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
    stop_string: str | None = None  # the stop string that ended it, if one did
    cached_tokens: int = 0
    state_slot: int | None = None  # recurrent-state slot while it holds KV (hybrid models)
    # the chain key of a cached snapshot its slot takes before its first step (admitted
    # with a cached prefix; ember.kv.snapshots)
    state_restore: bytes | None = None
    lora: Any = None  # its LoRA adapter (ember.models.lora.LoRAAdapter); None: the base model
    text: str = ""  # full output text (stop string excluded once found)
    emitted_chars: int = 0  # how much of ``text`` has been streamed out
    streamed_tokens: int = 0  # how many output tokens have been streamed out
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with params.prompt_logprobs: one per prompt token, None for the first (no context)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    last_chunk: int = 0  # prompt tokens its last prefill step computed (the scheduler's)
    admitted_time: float | None = None  # first admission (queue time ends here)
    first_token_time: float | None = None
    retry_after: float | None = None  # when rejected: seconds until it would fit
    admitted_seq: int = 0  # admission order, for preemption (latest goes first)
    timeline: Timeline = field(default_factory=Timeline)

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

    def check_invariant(self, uncomputed: int = 1) -> None:
        """Right after a token is committed, exactly that token is not yet cached (a
        hybrid model's rewound verify: also the accepted drafts it recomputes)."""
        if len(self.token_ids) != self.kv_len + uncomputed:
            raise InvalidDecodeState(
                f"request {self.request_id}: history {len(self.token_ids)} != "
                f"kv_len {self.kv_len} + {uncomputed}"
            )

    # ------------------------------------------------------------ streaming
    def take_delta(self) -> str:
        """Text that is safe to stream now.

        While stop strings are set, a tail that is a prefix of one of them is held
        back until it either completes the stop string or turns out not to.
        """
        end = len(self.text)
        if self.stops.strings and not self.is_finished:
            end -= self.stops.held_back(self.text)
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = max(self.emitted_chars, end)
        return delta

    @property
    def group_size(self) -> int:
        """Sequences this request occupies once admitted: itself and its forks."""
        return 1 + len(self.forks)
