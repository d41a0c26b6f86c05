"""LLMEngine: the synchronous core. ``step()`` reads as schedule → run → postprocess.

Intake is split in two: :meth:`LLMEngine.prepare` validates a request and builds
its state (sampler, grammar matcher) and is safe to call from any thread, so the
server does that work off the engine thread; :meth:`LLMEngine.enqueue` hands the
prepared requests to the scheduler and belongs to the engine thread.

``n > 1`` choices of one prompt are one group: only the first request is
scheduled; when its prompt is computed and its first token sampled, the siblings
are forked from it at that very step (they share its full KV blocks, copy its
partly filled last block, and sample their first tokens from the same logits).

Failure handling: if the forward pass raises, every request in that step is failed
with the error and its cache rewound to where it was (the invariant holds again);
if sampling or stop handling of one request raises, only that request fails (and
``error_param`` names the request parameter at fault, such as its grammar). In
both cases the engine keeps serving the others, and the failed requests' blocks
are released like any finished request's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.chat_template import ChatTemplate, ChatTemplateError
from ember.config import EngineConfig, InvalidConfig
from ember.engine.costs import StepCostModel, StepShape
from ember.engine.request import FinishReason, Request
from ember.engine.runner import ModelRunner, ScheduledRow
from ember.engine.scheduler import SEAT_MARGIN, Scheduler
from ember.errors import EmberError, InvalidDecodeState
from ember.kv.blocks import KV_DTYPES, KVStorage, OutOfBlocks
from ember.kv.disk import BlockRecord, DiskStore
from ember.kv.disk import fingerprint as disk_fingerprint
from ember.kv.manager import KVCacheManager
from ember.kv.prefix import extend_keys, tenant_salt
from ember.kv.tier import DiskTier, restore_chain
from ember.models.footprint import memory_summary
from ember.models.loader import LoadedModel, load_model, physical_cores
from ember.models.moe import MoEOptions
from ember.sampling.constraints import GrammarCompiler, GrammarError
from ember.sampling.params import SamplingParams
from ember.sampling.reasoning import (
    ThinkingBudget,
    ThinkingTags,
    answer_reserve,
    open_in_prompt,
)
from ember.sampling.sampler import (
    LogitProcessor,
    Sampler,
    SampleRow,
    TokenLogprobs,
    can_speculate,
    sample_rows,
)
from ember.spec.index import RecyclingTable, SuffixAutomaton
from ember.spec.speculator import TOPK, Proposal, SpecStats, Speculator
from ember.tokenizer import IncrementalDetokenizer

log = logging.getLogger("ember.engine")
REFERENCE_CACHE = 32  # frozen reference indexes kept for reuse across requests
FEED_ROWS = 4  # requests per step whose verification logits feed the recycling tables
# While the gate grants no draft (a batch whose steps are compute-bound: only
# near-certain drafts pay, and recycled ones never are), the tables are fed only every
# this many steps: the feed (a top-k over the vocabulary and the table updates) cost
# SmolLM2 at 16 streams ~5% of its throughput for drafts nobody could take.
IDLE_FEED_EVERY = 8
# Share of a TTFT objective the engine plans for: the rest is for what happens outside
# it (reading and preparing the request, streaming the first token back).
TTFT_MARGIN = 0.9


@dataclass(frozen=True)
class SLO:
    """Latency objectives of a request: seconds to the first token, seconds per token.

    With ``ttft``, a request the engine predicts cannot start in time — or that has
    already waited past it — is refused (``finish_reason="rejected"``, with a
    ``retry_after``) instead of being served late. With ``tpot``, steps carry only as
    many prompt tokens as keep its stream within it (stall-free chunked prefill).
    """

    ttft: float | None = None
    tpot: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise InvalidRequest(f"slo.{name}", f"must be a positive number of seconds, "
                                                    f"got {value!r}")


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
    error_param: str | None = None  # set when the request's own parameter caused ``error``
    retry_after: float | None = None  # rejected: seconds until it would likely be served
    queued_seconds: float | None = None  # arrival to admission, once admitted
    spec: SpecStats | None = None  # what speculation did (None: it did not speculate)
    # with SamplingParams.prompt_logprobs, once finished: one per prompt token (None first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_token_ids: list[int] | None = None  # set with prompt_logprobs

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor | None:
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


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.set_num_threads(config.threads or physical_cores())
        self.loaded = loaded or load_model(
            config.model, config.weights, MoEOptions(config.moe_stream, config.moe_cache_bytes))
        if config.chat_template is not None:  # a copy: a shared LoadedModel stays as it was
            self.loaded = dataclasses.replace(self.loaded, chat_template=_template(
                config.chat_template, self.loaded))
        cfg = self.loaded.config
        kv_dtype = KV_DTYPES[config.kv_dtype]
        if not kv_dtype.fits(cfg.head_dim):
            raise InvalidConfig(
                f"kv_dtype {config.kv_dtype!r} stores each head's row in blocks of "
                f"{kv_dtype.block} values, but {self.loaded.path.name} has head_dim "
                f"{cfg.head_dim}, not a multiple of {kv_dtype.block}: choose another kv_dtype")
        if not config.allow_drift:
            from ember.eval import check_drift, model_sha

            why = check_drift(model_sha(self.loaded), self.loaded.weights, config.kv_dtype)
            if why is not None:
                raise InvalidConfig(why)
        source = self.loaded.chat_template.source if self.loaded.chat_template else None
        self.thinking_tags = ThinkingTags.of_template(source)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or cfg.context_length, cfg.context_length)
        block_bytes = KVStorage.bytes_per_block_of(
            cfg.n_layers, config.block_size, cfg.n_kv_heads, cfg.head_dim, kv_dtype)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // block_bytes)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        storage = self.loaded.model.new_kv_storage(num_blocks, config.block_size, kv_dtype)
        log.info("KV cache: %d blocks of %d tokens, %s, %.1f KiB per token, %.0f MiB",
                 num_blocks, config.block_size, config.kv_dtype,
                 block_bytes / config.block_size / 1024, num_blocks * block_bytes / 2**20)
        log.info("%s", memory_summary(self.loaded.model, num_blocks * block_bytes,
                                      block_bytes // config.block_size, config.kv_dtype))
        self.runner = ModelRunner(self.loaded.model, storage)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk, StepCostModel())
        self.model_salt = self.loaded.fingerprint().encode()
        self.disk: DiskStore | None = None
        if config.kv_cache_dir is not None:
            self._attach_disk_tier(storage)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._fork_parent: dict[str, Request] = {}  # pending sibling id -> the request it forks
        self._aborts: set[str] = set()
        self._refused: list[Request] = []  # rejected at enqueue, reported at the next step
        self._lock = threading.Lock()  # guards _aborts and the lazy grammar compiler
        self._grammars: GrammarCompiler | None = None
        self._references: OrderedDict[str, SuffixAutomaton] = OrderedDict()
        self._recycling_tables: dict[str, RecyclingTable] = {}
        self._shared_references = [self._reference(t) for t in config.spec_references]
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        # speculation over finished requests: per source [drafted, accepted], bonus, steps
        self.spec_totals: dict[str, Any] = {"sources": {}, "bonus": 0, "steps": {
            "verify": 0, "fallback": 0, "off": 0}}
        self._start_costs()

    def kv_fingerprint(self) -> bytes:
        """What stored KV bytes depend on besides their tokens and salt: the weights
        (file hash and format), the KV dtype, the block size and the geometry."""
        c, cfg = self.config, self.loaded.config
        return disk_fingerprint(self.loaded.fingerprint(), f"kv:{c.kv_dtype}",
                                f"block:{c.block_size}", f"layers:{cfg.n_layers}",
                                f"kv_heads:{cfg.n_kv_heads}", f"head_dim:{cfg.head_dim}",
                                "layout:block,layer,kv,pos,head,dim")

    def export_prefix(self, tokens: Sequence[int], tenant: str | None = None
                      ) -> list[BlockRecord]:
        """The cached full blocks of ``tokens`` (the longest cached prefix), as records."""
        prefix = self.kv.prefix
        if prefix is None:
            return []
        salt = self.salt_for(tenant)
        keys: list[bytes] = []
        extend_keys(keys, salt, tokens, self.config.block_size)
        return [BlockRecord(*prefix.identity(hit.block), self.runner.kv.block_bytes(hit.block))
                for hit in prefix.lookup(salt, tokens, keys)]

    def import_prefix(self, records: Sequence[BlockRecord], tenant: str | None = None) -> int:
        """Cache ``records`` (a chain from the first block, as :meth:`export_prefix` gives)
        for ``tenant``; returns how many tokens they cover. Records that do not verify
        for this tenant (salt, chain keys, parents) end the import."""
        prefix = self.kv.prefix
        if prefix is None or not records:
            return 0
        salt = self.salt_for(tenant)
        tokens = [t for rec in records for t in rec.tokens]
        keys: list[bytes] = []
        extend_keys(keys, salt, tokens, self.config.block_size)
        found = prefix.lookup(salt, tokens, keys)
        restore_chain(prefix, self.runner.kv, salt, tokens, keys, found,
                      lambda i: records[i], len(keys), stored=False)
        return len(found) * self.config.block_size

    def _attach_disk_tier(self, storage: KVStorage) -> None:
        """Back the prefix cache with a block store under ``config.kv_cache_dir``."""
        c = self.config
        assert c.kv_cache_dir is not None
        self.disk = DiskStore(c.kv_cache_dir, self.kv_fingerprint(), c.kv_disk_bytes,
                              c.kv_fsync)

        def recompute_seconds(tokens: int, end: int) -> float:
            return self.scheduler.costs.predict(StepShape(tokens, 1, tokens * end))

        self.kv.attach_tier(DiskTier(self.disk, storage, recompute_seconds, c.kv_restore))

    def close(self) -> None:
        """Finish writing the disk tier and the expert histogram (if any). The engine
        stays usable."""
        if self.disk is not None:
            self.disk.flush()
        if self.loaded.model.experts is not None:
            self.loaded.model.experts.flush()

    def _start_costs(self) -> None:
        """The step-cost model's starting point (calibrating runs requests: do it last)."""
        from ember.engine.calibrate import initial_costs

        coefficients = initial_costs(self, self.config.calibrate_costs)
        self.scheduler.costs = StepCostModel(coefficients)
        self.stats.update(prompt_tokens=0, generation_tokens=0, steps=0)

    # ---------------------------------------------------------------- intake
    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (built on first use; safe to call from any thread)."""
        if self._grammars is None:
            with self._lock:
                if self._grammars is None:
                    self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars

    def _thinking_budget(self, prompt_ids: list[int], p: SamplingParams) -> ThinkingBudget:
        """The processor ending the reasoning: after ``p.thinking_budget`` tokens, and
        always early enough to leave the answer its share of ``max_tokens``."""
        if self.thinking_tags is None:
            raise InvalidRequest("thinking_budget", "the model's chat template has no "
                                 "thinking tags")
        opened = open_in_prompt(self.tokenizer.decode(prompt_ids[-16:]), self.thinking_tags)
        proc = ThinkingBudget(self.tokenizer, self.thinking_tags, p.thinking_budget or 0,
                              opened)
        if p.max_tokens is not None:
            proc.budget = min(proc.budget, max(0, p.max_tokens - len(proc.close_ids)
                                               - answer_reserve(p.max_tokens)))
        return proc

    def salt_for(self, tenant: str | None) -> bytes:
        """Prefix-cache salt: model fingerprint + tenant. Never from request content."""
        return tenant_salt(self.model_salt, tenant)

    def prepare(
        self,
        prompt_ids: list[int],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        processors: Sequence[LogitProcessor] = (),
        priority: int = 0,
        slo: SLO | None = None,
        weight: float = 1.0,
        arrival: float | None = None,
        references: Sequence[str] = (),
    ) -> list[Request]:
        """Validate and build the requests for one prompt: one per ``params`` (n choices).

        ``tenant`` scopes the prefix cache and is the fair-share account; ``weight`` is
        that tenant's share relative to others; ``priority`` orders service (lower
        first); ``references`` are texts its drafts may copy from (speculation; the
        server's ``--spec-ref`` texts always are); ``slo`` sets latency objectives (see
        :class:`SLO`); ``arrival`` is when
        the request arrived (``time.monotonic()``; default: now), which its TTFT counts
        from — the server passes the moment it started reading the request.

        Thread-safe; raises :class:`InvalidRequest` naming the culprit. Grammars are
        compiled here (cached), so a bad one fails before anything is queued.
        """
        choices = [params] if isinstance(params, SamplingParams) else list(params)
        if not 1 <= len(choices) <= self.config.max_num_seqs:
            raise InvalidRequest("n", f"n must be between 1 and max_num_seqs "
                                      f"({self.config.max_num_seqs}), got {len(choices)}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest("priority", f"must be an integer, got {priority!r}")
        if not (isinstance(weight, int | float) and weight > 0):
            raise InvalidRequest("weight", f"must be a positive number, got {weight!r}")
        if processors and len(choices) > 1:
            raise InvalidRequest("processors", "processors hold per-request state; pass them "
                                               "for a single choice only")
        for p in choices:
            prompt_ids = self._validate_prompt(prompt_ids, p)
        if slo is not None and slo.tpot is not None:
            self._check_tpot_attainable(slo.tpot, len(prompt_ids), len(choices))
        group = []
        for j, p in enumerate(choices):
            procs = list(processors)
            if p.structured is not None:
                try:
                    procs.append(self.grammars.processor(p.structured))
                except GrammarError as e:
                    raise InvalidRequest("structured", str(e)) from None
            if p.thinking_budget is not None:
                procs.append(self._thinking_budget(prompt_ids, p))
            if request_id is None:
                rid = f"req-{next(self._ids)}"
            else:
                rid = request_id if j == 0 else f"{request_id}-{j}"
            group.append(Request(
                request_id=rid,
                prompt_ids=list(prompt_ids),
                params=p,
                sampler=Sampler(p, self.loaded.config.vocab_size, prompt_ids, procs),
                block_table=self.kv.new_table(),
                detokenizer=IncrementalDetokenizer(self.tokenizer),
                eos_ids=frozenset(self.tokenizer.eog_ids),
                max_total_tokens=self.max_model_len,
                salt=self.salt_for(tenant),
                tenant=tenant or "",
                priority=priority,
                weight=float(weight),
                slo_ttft=slo.ttft if slo else None,
                slo_tpot=slo.tpot if slo else None,
                arrival_time=time.monotonic() if arrival is None else arrival,
                speculator=self._speculator(prompt_ids, p, procs, tenant, references),
                prompt_logprobs=[None] if p.prompt_logprobs is not None else [],
            ))
        return group

    def _speculator(self, prompt_ids: list[int], params: SamplingParams,
                    processors: list[LogitProcessor], tenant: str | None,
                    references: Sequence[str]) -> Speculator | None:
        """A request's draft sources, or None when it does not speculate."""
        if (self.config.speculation == "off" or not params.speculation
                or not can_speculate(processors)):
            return None
        grammar = next((p for p in processors if hasattr(p, "forced_tokens")), None)
        documents = list(self._shared_references) + [self._reference(t) for t in references]
        # a grammar cannot look past the end of generation even when it is ignored
        enders = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos and grammar is None
            else frozenset(self.tokenizer.eog_ids))
        return Speculator(prompt_ids, documents=documents, recycling=self._recycling(tenant),
                          grammar=grammar, max_draft=self.config.spec_max_draft,
                          enders=enders, vocab_size=self.loaded.config.vocab_size)

    def _reference(self, text: str) -> SuffixAutomaton:
        """The frozen index of a reference text (built once, kept for reuse)."""
        with self._lock:
            index = self._references.get(text)
            if index is not None:
                self._references.move_to_end(text)
                return index
        index = SuffixAutomaton()
        for token in self.tokenizer.encode(text):
            index.extend(token)
        index.freeze()
        with self._lock:
            self._references[text] = index
            while len(self._references) > REFERENCE_CACHE:
                self._references.popitem(last=False)
        return index

    def _recycling(self, tenant: str | None) -> RecyclingTable:
        """The tenant's table of recent top-k successors (draft indexes never cross
        tenants: what one tenant's logits ranked is never drafted for another)."""
        with self._lock:
            table = self._recycling_tables.get(tenant or "")
            if table is None:
                table = RecyclingTable(self.loaded.config.vocab_size)
                self._recycling_tables[tenant or ""] = table
            return table

    def _check_tpot_attainable(self, tpot: float, context: int, rows: int) -> None:
        """Refuse a TPOT objective that no schedule can meet: the request's own decode
        step, with nothing else running, is predicted to take longer. (Admission only
        seats a stream whose step fits its objective, so such a request would otherwise
        wait for ever.)"""
        alone = self.scheduler.costs.predict(StepShape(rows, rows, context, decode_rows=rows,
                                                       logits=rows))
        if alone > SEAT_MARGIN * tpot:
            raise InvalidRequest("slo.tpot_ms", f"a decode step of this request alone is "
                                 f"predicted to take {alone * 1e3:.1f} ms on this server, "
                                 f"so {tpot * 1e3:g} ms per output token cannot be met")

    def check_queue(self, pending: int = 0) -> None:
        """Raise :class:`QueueFull` if the waiting queue (plus ``pending`` prompts that
        are on their way in) leaves no room for one more."""
        if len(self.scheduler.waiting) + pending >= self.config.max_queue:
            raise QueueFull(f"waiting queue is full ({self.config.max_queue} requests)")

    def enqueue(self, group: list[Request]) -> None:
        """Queue a prepared group (engine thread only); the first request is scheduled,
        the others fork from it when its prompt is computed. A group whose first token
        is predicted to come after its TTFT objective is refused: it finishes as
        ``rejected`` at the next step, with a ``retry_after``."""
        for req in group:
            if req.request_id in self._requests:
                raise InvalidRequest("request_id",
                                     f"request id {req.request_id!r} is already in use")
        parent, *siblings = group
        for req in group:
            self._requests[req.request_id] = req
        if parent.slo_ttft is not None:
            waited = time.monotonic() - parent.arrival_time
            predicted = waited + self.scheduler.predict_ttft(parent)
            if predicted > TTFT_MARGIN * parent.slo_ttft:
                self._refuse(group, predicted - TTFT_MARGIN * parent.slo_ttft)
                return
        parent.forks = siblings
        for sibling in siblings:
            self._fork_parent[sibling.request_id] = parent
        self.scheduler.add(parent)

    def _refuse(self, group: list[Request], retry_after: float) -> None:
        for req in group:
            req.retry_after = retry_after
            req.finish(FinishReason.REJECTED, "the request would miss its time-to-first-token "
                       f"objective ({req.slo_ttft:g} s)")
        self._refused += group

    def _shed_hopeless(self) -> list[Request]:
        """Refuse waiting requests that can no longer start within their TTFT objective:
        serving them would spend capacity on answers that miss anyway."""
        lost = self.scheduler.hopeless(time.monotonic(), TTFT_MARGIN)
        for req in lost:
            req.retry_after = req.slo_ttft
            req.finish(FinishReason.REJECTED, "the request cannot get its first token "
                       f"within its objective ({req.slo_ttft:g} s)")
        return lost

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        processors: Sequence[LogitProcessor] = (),
        priority: int = 0,
        slo: SLO | None = None,
        weight: float = 1.0,
    ) -> Request:
        """Prepare and queue one request (caller on the engine's thread)."""
        return self.add_group(prompt_ids, [params], request_id=request_id, tenant=tenant,
                              processors=processors, priority=priority, slo=slo,
                              weight=weight)[0]

    def add_group(
        self,
        prompt_ids: list[int],
        params: Sequence[SamplingParams],
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        processors: Sequence[LogitProcessor] = (),
        priority: int = 0,
        slo: SLO | None = None,
        weight: float = 1.0,
    ) -> list[Request]:
        """Prepare and queue ``len(params)`` choices of one prompt, sharing its KV (the
        options are :meth:`prepare`'s)."""
        group = self.prepare(prompt_ids, params, request_id=request_id, tenant=tenant,
                             processors=processors, priority=priority, slo=slo, weight=weight)
        self.check_queue()
        self.enqueue(group)
        return group

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
        changed = self._apply_aborts() + self._shed_hopeless()
        changed += self._refused
        for req in self._refused:
            self._requests.pop(req.request_id, None)
        self._refused = []
        self._retire()  # an aborted request must not be scheduled, even once
        sched = self.scheduler.schedule(self._proposals)
        if sched.rows:
            self.stats["steps"] += 1
            start = time.perf_counter()
            changed += self._run(sched.rows)
            self.scheduler.costs.observe(sched.shape, time.perf_counter() - start)
        elif self.kv.tier is not None:
            self.kv.tier.wait_for_reads(0.005)  # only disk reads to wait for: do not spin
        self._retire()
        return [self.output(r) for r in dict.fromkeys(changed)]

    def _proposals(self) -> dict[Request, Proposal]:
        """Drafts of the decoding requests that speculate (the gate picks among them)."""
        out = {}
        for req in self.scheduler.running:
            spec = req.speculator
            if spec is None or req.remaining_prefill != 1 or not spec.due():
                continue
            proposal = spec.propose()
            if proposal is None:
                spec.stats.fallback_steps += 1
            else:
                out[req] = proposal
        return out

    def _retire(self) -> None:
        """Drop finished requests: free their blocks, let their pending forks go alone."""
        finished = self.scheduler.remove_finished()
        self._release_forks(finished)
        for req in finished:
            self._requests.pop(req.request_id, None)
            if req.speculator is not None:
                self._count_spec(req.speculator.stats)

    def _count_spec(self, s: SpecStats) -> None:
        t = self.spec_totals
        for name, (drafted, accepted) in s.by_source.items():
            source = t["sources"].setdefault(name, [0, 0])
            source[0] += drafted
            source[1] += accepted
        t["bonus"] += s.bonus
        for kind in ("verify", "fallback", "off"):
            t["steps"][kind] += getattr(s, f"{kind}_steps")

    def _run(self, rows: list[ScheduledRow]) -> list[Request]:
        self._zero_fresh_blocks()
        try:
            logits = self.runner.execute(rows)
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            log.exception("forward pass failed")
            for row in rows:  # nothing was committed: the invariant already holds
                row.request.finish(FinishReason.ERROR, f"forward pass failed: {e}")
            return [row.request for row in rows]
        verify, scored, offset = [], [], 0
        for row in rows:
            req = row.request
            if not req.num_output:
                self.stats["prompt_tokens"] += row.num_tokens
            req.block_table.kv_len += row.num_tokens  # the history it computed
            self.kv.register_computed(req)
            if row.prompt_positions:
                n = len(row.prompt_positions)
                self._record_prompt_logprobs(row, logits[offset:offset + n])
                offset += n
            if row.samples and req.params.max_tokens == 0:
                req.finish(FinishReason.LENGTH)  # only the prompt was asked for
                scored.append(req)
            elif row.samples:
                verify.append((row, logits[offset:offset + row.num_sampled]))
                offset += row.num_sampled
        changed = scored + self._verify(verify)
        for row, row_logits in verify:
            req = row.request
            if req.forks and req.num_output == 1 and req.finish_reason is not FinishReason.ERROR:
                changed += self._fork(req, row_logits[0])
        return changed

    @staticmethod
    def _record_prompt_logprobs(row: ScheduledRow, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after ``row.prompt_positions``, from the model's
        raw distribution (no sampling parameters apply to a prompt)."""
        req, n_top = row.request, row.request.params.prompt_logprobs or 0
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        following = torch.tensor([req.prompt_ids[p + 1] for p in row.prompt_positions])
        chosen = logprobs.gather(1, following[:, None])[:, 0].tolist()
        top = logprobs.topk(n_top) if n_top else None
        for i, token in enumerate(following.tolist()):
            alternatives = (list(zip(top.indices[i].tolist(), top.values[i].tolist(),
                                     strict=True)) if top is not None else [])
            req.prompt_logprobs.append(TokenLogprobs(token, chosen[i], alternatives))

    def _verify(self, verify: list[tuple[ScheduledRow, torch.Tensor]]) -> list[Request]:
        """Sample every row — plain rows and draft-verify rows alike, in one batch — and
        commit each request's tokens. A request's failure fails it alone."""
        batch: list[SampleRow] = []
        plans = []
        for row, row_logits in verify:
            req = row.request
            try:
                processed = self._processed(req, row_logits, row.draft)
            except Exception as e:
                self._fail(req, e)
                continue
            plans.append((row, row_logits, len(batch)))
            batch += [SampleRow(req.sampler, row_logits[j], processed[j], row.draft[:j],
                                req.num_output + j) for j in range(len(row.draft) + 1)]
        raw = _stacked([row_logits for _, row_logits, _ in plans])
        results = sample_rows(batch, raw)
        drafting = any(row.draft for row, _ in verify)
        topk = (self._recycling_feed(plans, raw)
                if drafting or self.stats["steps"] % IDLE_FEED_EVERY == 0 else {})
        changed = [row.request for row, _ in verify]
        for row, _, start in plans:
            n = len(row.draft) + 1
            try:
                self._commit(row, topk.get(row.request), results[start:start + n])
            except InvalidDecodeState:
                raise  # an engine bug: fail loudly, not as one request's error
            except Exception as e:
                self._fail(row.request, e)
        return changed

    def _recycling_feed(self, plans: list[tuple[ScheduledRow, torch.Tensor, int]],
                        raw: torch.Tensor | None) -> dict[Request, torch.Tensor]:
        """Top-k rows for the recycling tables, from at most FEED_ROWS requests a step
        (in turn): a table of successors fills as well from a few streams, and a top-k
        over every row of a full batch would cost more than its drafts win there."""
        wanting = [(row, start) for row, _, start in plans
                   if row.request.speculator is not None and row.request.speculator.wants_topk]
        if raw is None or not wanting:
            return {}
        if len(wanting) > FEED_ROWS:
            turn = self.stats["steps"] * FEED_ROWS % len(wanting)
            wanting = (wanting + wanting)[turn:turn + FEED_ROWS]
        index = torch.cat([torch.arange(start, start + len(row.draft) + 1)
                           for row, start in wanting])
        topk = raw.index_select(0, index).topk(TOPK).indices
        out, at = {}, 0
        for row, _ in wanting:
            n = len(row.draft) + 1
            out[row.request] = topk[at:at + n]
            at += n
        return out

    @staticmethod
    def _processed(req: Request, row_logits: torch.Tensor, draft: list[int]
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

    def _commit(self, row: ScheduledRow, topk: torch.Tensor | None,
                results: list[tuple[int, TokenLogprobs | None]]) -> None:
        """The one place a request's progress advances after its forward pass.

        Commits sampled tokens while they equal the draft, then the first that differs
        (the correction) or, after a fully accepted draft, the bonus; stops at a token
        that finishes the request. The KV of rejected draft positions is dropped, and
        only committed full blocks are registered in the prefix cache.
        """
        req, draft = row.request, row.draft
        computed = req.kv_len  # the whole history; drafts sit after it
        committed: list[int] = []
        for j, (token, lp) in enumerate(results):
            req.sampler.commit(token)
            req.append_token(token, lp)
            committed.append(token)
            if req.is_finished or j == len(draft) or token != draft[j]:
                break
        req.block_table.kv_len = computed + len(draft)  # what the forward pass wrote
        self.kv.truncate(req, computed + len(committed) - 1)  # keep accepted drafts only
        self.kv.register_computed(req)
        req.check_invariant()
        self.stats["generation_tokens"] += len(committed)
        spec = req.speculator
        if spec is not None:
            spec.observe(committed)
            if spec.wants_topk and topk is not None:
                inputs = [req.token_ids[computed - 1], *draft][:len(committed)]
                spec.observe_topk(inputs, topk[:len(committed)])
            if draft and row.proposal is not None:
                accepted = 0
                while (accepted < min(len(committed), len(draft))
                       and committed[accepted] == draft[accepted]):
                    accepted += 1
                spec.feedback(row.proposal, len(draft), accepted,
                              bonus=len(committed) == len(draft) + 1)

    def _fail(self, req: Request, e: Exception) -> None:
        param = getattr(e, "param", None)  # set when the request's own input is at fault
        log.log(logging.INFO if param else logging.WARNING, "request %s failed: %s",
                req.request_id, e)
        self.kv.truncate(req, len(req.token_ids) - 1)
        req.finish(FinishReason.ERROR, str(e), param)

    def _zero_fresh_blocks(self) -> None:
        """Zero blocks handed out for the first time, before anything reads them."""
        fresh = self.kv.allocator.take_fresh()
        if fresh:
            self.runner.kv.zero_blocks(fresh)

    def _sample(self, req: Request, logits: torch.Tensor) -> None:
        """Sample and commit one token from one row (a forked sibling's first token)."""
        try:
            token, lp = req.sampler.sample(logits, req.token_ids, req.num_output)
            req.append_token(token, lp)
            req.check_invariant()
            self.stats["generation_tokens"] += 1
            if req.speculator is not None:
                req.speculator.observe([token])
        except InvalidDecodeState:
            raise
        except Exception as e:
            self._fail(req, e)

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[Request]:
        """Start the parent's siblings from its just-computed prompt and logits row."""
        siblings, parent.forks = parent.forks, []
        started, fallback = [], []
        for child in siblings:
            self._fork_parent.pop(child.request_id, None)
            try:
                copy = self.kv.fork(parent, child)
            except OutOfBlocks:  # no block for its own copy: it prefills on its own
                fallback.append(child)
                continue
            if copy is not None:
                self._zero_fresh_blocks()  # before the copy fills one of them
                self.runner.kv.copy_block(*copy)
            if parent.params.prompt_logprobs is not None:
                child.prompt_logprobs = list(parent.prompt_logprobs)
            self.scheduler.start_running(child)
            self._sample(child, logits)
            started.append(child)
        self.scheduler.requeue(fallback)
        return started

    def _release_forks(self, finished: list[Request]) -> None:
        """Siblings of a request that ended before its prompt was computed prefill alone."""
        for req in finished:
            if req.forks:
                for child in req.forks:
                    self._fork_parent.pop(child.request_id, None)
                self.scheduler.requeue(req.forks)
                req.forks = []

    def _apply_aborts(self) -> list[Request]:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        aborted = []
        for rid in ids:
            req = self._requests.get(rid)
            if req is None or req.is_finished:
                continue
            req.finish(FinishReason.ABORT)
            aborted.append(req)
            parent = self._fork_parent.pop(rid, None)
            if parent is not None:  # a sibling still waiting for its fork: no blocks held
                parent.forks.remove(req)
                self._requests.pop(rid)
        return aborted

    def output(self, req: Request) -> RequestOutput:
        """The request's state for its caller; consumes the pending delta."""
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
            error_param=req.error_param,
            retry_after=req.retry_after,
            queued_seconds=(req.admitted_time - req.arrival_time
                            if req.admitted_time is not None else None),
            spec=req.speculator.stats if req.speculator is not None else None,
            prompt_logprobs=(req.prompt_logprobs if req.params.prompt_logprobs is not None
                             and req.is_finished else None),
            prompt_token_ids=req.prompt_ids if req.params.prompt_logprobs is not None else None,
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
            "tenants": self._tenant_counts(),
            "spec": self.spec_totals,
            "kv_disk": self.disk_metrics(),
            "moe": self.moe_metrics(),
            **self.stats,
        }

    def moe_metrics(self) -> dict[str, Any] | None:
        """The expert store's counters (a mixture-of-experts model only)."""
        experts = self.loaded.model.experts
        if experts is None:
            return None
        return {**experts.stats.as_dict(), "streamed": experts.streamed,
                "cached_bytes": experts.cached_bytes}

    def disk_metrics(self) -> dict[str, Any] | None:
        """The disk tier's counters, decisions and size; None without a disk tier."""
        tier = self.kv.tier
        if self.disk is None or tier is None:
            return None
        return {**dataclasses.asdict(self.disk.stats), "blocks": len(self.disk),
                "bytes": self.disk.size_bytes, "decisions": dict(tier.decisions),
                "restored_blocks": tier.restored_blocks,
                "read_bytes_per_second": tier.read_bps}

    def _tenant_counts(self) -> dict[str, dict[str, int]]:
        """Running and waiting requests per tenant (safe to call from any thread)."""
        counts: dict[str, dict[str, int]] = {}
        for state, reqs in (("running", list(self.scheduler.running)),
                            ("waiting", list(self.scheduler.waiting))):
            for req in reqs:
                counts.setdefault(req.tenant, {"running": 0, "waiting": 0})[state] += 1
        return counts


def _template(source: str, loaded: LoadedModel) -> ChatTemplate:
    """A chat template given as text, with the model's BOS/EOS texts."""
    old, tok = loaded.chat_template, loaded.tokenizer

    def text(token: int | None) -> str:
        return "" if token is None else tok.token_bytes(token).decode("utf-8", "replace")

    try:
        return ChatTemplate(source, bos_token=old.bos_token if old else text(tok.bos_id),
                            eos_token=old.eos_token if old else text(tok.eos_id))
    except ChatTemplateError as e:
        raise InvalidConfig(f"chat_template: {e}") from None
