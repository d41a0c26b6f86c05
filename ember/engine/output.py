"""What a caller sees of a request: cumulative fields plus what changed since last time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ember.engine.request import Request, Timeline
from ember.sampling.sampler import TokenLogprobs
from ember.spec.speculator import SpecStats


@dataclass
class RequestOutput:
    """A request's state as seen by a caller: cumulative fields plus the latest delta."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finished: bool
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # all tokens' (set once finished)
    delta_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    error_param: str | None = None  # set when the request's own parameter caused ``error``
    retry_after: float | None = None  # rejected: seconds until it would likely be served
    queued_seconds: float | None = None  # arrival to admission, once admitted
    spec: SpecStats | None = None  # what speculation did (None: it did not speculate)
    timeline: Timeline | None = None  # when its work ran (set once finished: its trace)
    # with SamplingParams.prompt_logprobs, once finished: one per prompt token (None first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_token_ids: list[int] | None = None  # set with prompt_logprobs
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def output(req: Request) -> RequestOutput:
    """The request's state for its caller; consumes the pending delta."""
    delta = req.take_delta()
    n_sent, out_ids = req.streamed_tokens, req.output_ids
    req.streamed_tokens = len(out_ids)
    want_lp = req.params.logprobs is not None
    with_prompt = req.params.prompt_logprobs is not None
    return RequestOutput(
        request_id=req.request_id,
        text=req.text,
        token_ids=out_ids,
        prompt_tokens=req.num_prompt,
        cached_tokens=req.cached_tokens,
        finished=req.is_finished,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        delta_text=delta,
        delta_token_ids=out_ids[n_sent:],
        logprobs=req.logprobs if want_lp and req.is_finished else None,
        delta_logprobs=req.logprobs[n_sent:] if want_lp else None,
        error=req.error,
        error_param=req.error_param,
        retry_after=req.retry_after,
        queued_seconds=(req.admitted_time - req.arrival_time
                        if req.admitted_time is not None else None),
        spec=req.speculator.stats if req.speculator is not None else None,
        timeline=_finished_timeline(req),
        prompt_logprobs=req.prompt_logprobs if with_prompt and req.is_finished else None,
        prompt_token_ids=req.prompt_ids if with_prompt else None,
        stop_string=req.stop_string,
    )


def _finished_timeline(req: Request) -> Timeline | None:
    if not req.is_finished:
        return None
    t = req.timeline
    if t.finished_time is None:
        t.finished_time = time.monotonic()
        t.arrival_time, t.admitted_time = req.arrival_time, req.admitted_time
        t.first_token_time = req.first_token_time
        t.grammar_seconds = sum(getattr(p, "mask_seconds", 0.0)
                                for p in req.sampler.processors)
    return t
