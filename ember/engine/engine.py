"""LLMEngine: the synchronous core. ``step()`` reads as schedule → run → postprocess.

Failure handling: if the forward pass raises, every request in that step is failed
with the error and its cache rewound to where it was (the invariant holds again);
if sampling or stop handling of one request raises, only that request fails. In
both cases the engine keeps serving the others, and the failed requests' blocks
are released like any finished request's.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.config import EngineConfig
from ember.engine.request import FinishReason, Request
from ember.engine.runner import ModelRunner
from ember.engine.scheduler import Scheduler
from ember.errors import EmberError
from ember.kv.blocks import KVStorage
from ember.kv.manager import KVCacheManager
from ember.models.loader import LoadedModel, load_model, physical_cores
from ember.sampling.constraints import GrammarCompiler, GrammarError
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import LogitProcessor, Sampler, TokenLogprobs
from ember.tokenizer import IncrementalDetokenizer

log = logging.getLogger("ember.engine")


class QueueFull(EmberError):
    """The waiting queue is at its bound; retry later (the server answers 429)."""


class InvalidRequest(EmberError, ValueError):
    """A request the engine cannot serve as given; ``param`` names the culprit."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.set_num_threads(config.threads or physical_cores())
        self.loaded = loaded or load_model(config.model, config.weights)
        cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or cfg.context_length, cfg.context_length)
        block_bytes = KVStorage.bytes_per_block(
            cfg.n_layers, config.block_size, cfg.n_kv_heads, cfg.head_dim, torch.float32)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // block_bytes)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        storage = self.loaded.model.new_kv_storage(num_blocks, config.block_size)
        self.runner = ModelRunner(self.loaded.model, storage)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.model_salt = self.loaded.fingerprint().encode()
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()  # guards _aborts only; the rest is engine-thread state
        self._grammars: GrammarCompiler | None = None
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

    # ---------------------------------------------------------------- intake
    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (built on first use; safe to call from any thread)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars

    def salt_for(self, tenant: str | None) -> bytes:
        """Prefix-cache salt: model fingerprint + tenant. Never from request content."""
        return self.model_salt + b"\0tenant:" + (tenant or "").encode()

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        processors: list[LogitProcessor] | tuple[()] = (),
    ) -> Request:
        prompt_ids = self._validate_prompt(prompt_ids, params)
        processors = list(processors)
        if params.structured is not None:
            try:
                processors.append(self.grammars.processor(params.structured))
            except GrammarError as e:
                raise InvalidRequest("structured", str(e)) from None
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFull(f"waiting queue is full ({self.config.max_queue} requests)")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequest("request_id", f"request id {rid!r} is already in use")
        req = Request(
            request_id=rid,
            prompt_ids=prompt_ids,
            params=params,
            sampler=Sampler(params, self.loaded.config.vocab_size, prompt_ids, processors),
            block_table=self.kv.new_table(),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            eos_ids=frozenset(self.tokenizer.eog_ids),
            max_total_tokens=self.max_model_len,
            salt=self.salt_for(tenant),
        )
        self._requests[rid] = req
        self.scheduler.add(req)
        return req

    def _validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        wanted = len(prompt_ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{wanted} exceeds the context window of {self.max_model_len} tokens",
            )
        blocks = -(-wanted // self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise InvalidRequest(
                "max_tokens",
                f"request needs {blocks} KV blocks, the pool has {self.kv.num_blocks}",
            )
        return prompt_ids

    def abort(self, request_id: str) -> None:
        """Cancel a request; it is finished and its blocks freed at the next step."""
        with self._lock:
            self._aborts.add(request_id)

    # ---------------------------------------------------------------- loop
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.num_unfinished)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return an output for every request that changed."""
        changed = self._apply_aborts()
        sched = self.scheduler.schedule()
        if sched.rows:
            self.stats["steps"] += 1
            changed += self._run(sched.rows)
        finished = self.scheduler.remove_finished()
        for req in finished:
            self._requests.pop(req.request_id, None)
        return [self._output(r) for r in dict.fromkeys(changed)]

    def _run(self, rows: list) -> list[Request]:
        before = [(row.request, row.request.kv_len) for row in rows]
        try:
            logits = self.runner.execute(rows)
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            log.exception("forward pass failed")
            for req, kv_len in before:
                self.kv.truncate(req, kv_len)
                req.finish(FinishReason.ERROR, f"forward pass failed: {e}")
            return [req for req, _ in before]
        changed, i = [], 0
        for row in rows:
            req = row.request
            self.kv.register_computed(req)
            self.stats["prompt_tokens"] += row.num_tokens if not req.num_output else 0
            if not row.samples:
                continue
            try:
                token, lp = req.sampler.sample(logits[i], req.token_ids)
                req.append_token(token, lp)
                req.check_invariant()
                self.stats["generation_tokens"] += 1
            except Exception as e:  # this request only
                log.warning("request %s failed: %s", req.request_id, e)
                self.kv.truncate(req, len(req.token_ids) - 1)
                req.finish(FinishReason.ERROR, str(e))
            i += 1
            changed.append(req)
        return changed

    def _apply_aborts(self) -> list[Request]:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        aborted = []
        for rid in ids:
            req = self._requests.get(rid)
            if req is not None and not req.is_finished:
                req.finish(FinishReason.ABORT)
                aborted.append(req)
        return aborted

    def _output(self, req: Request) -> RequestOutput:
        delta = req.take_delta()
        n_sent, out_ids = req.streamed_tokens, req.output_ids
        req.streamed_tokens = len(out_ids)
        want_lp = req.params.logprobs is not None
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
        )

    # ---------------------------------------------------------------- introspection
    def metrics(self) -> dict[str, Any]:
        prefix = self.kv.prefix
        return {
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": self.kv.num_used,
            "prefix_cache_queries": prefix.queries if prefix else 0,
            "prefix_cache_hits": prefix.hits if prefix else 0,
            "preemptions": self.scheduler.num_preemptions,
            **self.stats,
        }
