"""LLMEngine: the synchronous core. ``step()`` reads as schedule → run → commit.

The engine is composed of nouns, each in its own module: :class:`Intake` builds and
validates requests (any thread), :class:`Admission` queues, refuses, sheds and
cancels them, the :class:`Scheduler` picks each step's rows, the
:class:`ModelRunner` computes them, :class:`Commit` writes what they produced, and
:class:`KVTransfer` moves KV in and out (export/import, the disk tier). This module
runs the step and the draft verification that joins them.

``n > 1`` choices of one prompt are one group: only the first request is
scheduled; when its prompt is computed and its first token sampled, the siblings
are forked from it at that very step (they share its full KV blocks, copy its
partly filled last block, and sample their first tokens from the same logits).

Failure handling: if the forward pass raises, every request in that step is failed
with the error (nothing was committed: the invariant already holds); if sampling or
stop handling of one request raises, only that request fails (and ``error_param``
names the request parameter at fault, such as its grammar). In both cases the
engine keeps serving the others, and the failed requests' blocks are released like
any finished request's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from ember.config import EngineConfig
from ember.engine.adapters import LoRARegistry
from ember.engine.admission import Admission
from ember.engine.calibrate import initial_costs
from ember.engine.commit import Commit, finish
from ember.engine.costs import StepCostModel, StepShape
from ember.engine.intake import SLO, Intake
from ember.engine.metrics import (
    TENANT_COUNTS,
    SpecTotals,
    load_summary,
    moe_metrics,
    snapshot,
)
from ember.engine.output import RequestOutput, output
from ember.engine.recurrent import RecurrentSteps, StateLayout, for_recurrent
from ember.engine.request import FinishReason, Request
from ember.engine.runner import ModelRunner, ScheduledRow, record_timelines
from ember.engine.scheduler import Scheduler
from ember.engine.served import served_model
from ember.engine.transfer import KVTransfer
from ember.engine.verify import (
    FEED_ROWS,
    IDLE_FEED_EVERY,
    finite_rows,
    processed,
    prompt_logprobs_of,
    recycling_feed,
    stacked,
)
from ember.errors import InvalidDecodeState
from ember.kv.blocks import KV_DTYPES, KVStorage, OutOfBlocks
from ember.kv.events import KVEvents, ZmqPublisher
from ember.kv.manager import KVCacheManager
from ember.kv.prefix import tenant_name, tenant_scope
from ember.models.footprint import memory_summary
from ember.models.loader import LoadedModel, load_model, physical_cores
from ember.models.lora import LoRAAdapter
from ember.models.moe import MoEOptions
from ember.sampling.params import SamplingParams
from ember.sampling.sampler import LogitProcessor, SampleRow, sample_rows
from ember.spec.speculator import Proposal

log = logging.getLogger("ember.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.set_num_threads(config.threads or physical_cores())
        moe = MoEOptions(config.moe_stream, config.moe_cache_bytes, config.moe_pilot,
                         config.moe_expert_top_p, config.moe_pinned_share)
        self.loaded = served_model(config, loaded or load_model(config.model, config.weights,
                                                                moe))
        cfg = self.loaded.config
        if cfg.recurrent:
            config = self.config = for_recurrent(config, cfg.state_bytes_per_sequence)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or cfg.context_length, cfg.context_length)
        kv_dtype = KV_DTYPES[config.kv_dtype]
        block_bytes = KVStorage.bytes_per_block_of(
            len(cfg.kv_layers), config.block_size, cfg.n_kv_heads, cfg.head_dim, kv_dtype)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // block_bytes)
        layout = StateLayout.of(config, cfg)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 state_slots=layout.slots, state_snapshots=layout.snapshots)
        if self.kv.prefix is not None:
            self.kv.prefix.cap = lambda scope: config.limits_for(tenant_name(scope)).share(
                "kv_share", num_blocks)
        storage = self.loaded.model.new_kv_storage(num_blocks, config.block_size, kv_dtype,
                                                   num_seqs=max(1, layout.slots),
                                                   num_snapshots=layout.snapshot_slots)
        log.info("KV cache: %d blocks of %d tokens, %s, %.1f KiB per token, %.0f MiB",
                 num_blocks, config.block_size, config.kv_dtype,
                 block_bytes / config.block_size / 1024, num_blocks * block_bytes / 2**20)
        log.info("%s", memory_summary(self.loaded.model, num_blocks * block_bytes,
                                      block_bytes // config.block_size, config.kv_dtype))
        states = getattr(storage, "states", None)
        self.recurrent = None if states is None else RecurrentSteps(layout, self.kv, states)
        if states is not None:
            log.info("%s", layout.describe(states))
        self.runner = ModelRunner(self.loaded.model, storage)
        self.loras = LoRARegistry(cfg, config.max_lora_rank, config.max_loras,
                                  LoRARegistry.dtype_for(config.lora_dtype, self.loaded.model),
                                  lambda tenant: config.limits_for(tenant).max_adapters)
        self.kv_events = self._publish_kv_events(storage)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk, StepCostModel(),
                                   lambda tenant: config.limits_for(tenant).max_running,
                                   config.max_prefill_step_seconds,
                                   lambda tenant: config.limits_for(tenant).share(
                                       "kv_share", num_blocks))
        self.intake = Intake(config, self.loaded, self.kv, self.max_model_len,
                             lambda shape: self.scheduler.costs.fastest(shape))
        self.thinking_tags = self.intake.thinking_tags
        self.admission = Admission(self.scheduler, config.max_queue)
        self.commit = Commit(self.kv)
        self.transfer = KVTransfer(config, cfg, self.loaded.fingerprint(), self.kv, storage,
                                   self.intake.salt_for)
        if config.kv_cache_dir is not None:
            self.transfer.attach_disk_tier(self._predict)
        self.steps = 0
        self._feeds = 0  # steps that fed the recycling tables (whose turn it is)
        self.spec_totals = SpecTotals()
        # calibrating runs requests through this engine: last
        self.scheduler.costs = StepCostModel(initial_costs(self, config.calibrate_costs))
        self.reset_counters()

    def _predict(self, shape: StepShape) -> float:
        return self.scheduler.costs.predict(shape)

    # ---------------------------------------------------------------- intake and queue
    def prepare(self, prompt_ids: list[int], params: SamplingParams | Sequence[SamplingParams],
                *, lora: str | None = None, **options: Any) -> list[Request]:
        """Validate and build one prompt's requests (any thread); see :meth:`Intake.prepare`.
        ``lora`` names a loaded adapter (:meth:`load_lora`) its tokens run with."""
        adapter = self._adapter(lora, tenant=options.get("tenant"))
        group = self.intake.prepare(prompt_ids, params, lora=adapter, **options)
        self.admission.check_quote(group)
        return group

    def _adapter(self, lora: str | None, request: bool = True,
                 tenant: str | None = None) -> LoRAAdapter | None:
        return self.loras.for_request(lora, request, tenant)

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load an adapter as ``name``; see :meth:`LoRARegistry.load`."""
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        self.loras.unload(name)

    def check_queue(self, pending: int = 0) -> None:
        self.admission.check_queue(pending)

    def enqueue(self, group: list[Request]) -> None:
        """Queue a prepared group (engine thread only); see :meth:`Admission.enqueue`."""
        self.admission.enqueue(group)

    def add_group(self, prompt_ids: list[int], params: Sequence[SamplingParams], *,
                  request_id: str | None = None, tenant: str | None = None,
                  processors: Sequence[LogitProcessor] = (), priority: int = 0,
                  slo: SLO | None = None, weight: float = 1.0,
                  lora: str | None = None) -> list[Request]:
        """Prepare and queue ``len(params)`` choices of one prompt, sharing its KV."""
        group = self.prepare(prompt_ids, params, request_id=request_id, tenant=tenant,
                             processors=processors, priority=priority, slo=slo, weight=weight,
                             lora=lora)
        self.check_queue()
        self.enqueue(group)
        return group

    def add_request(self, prompt_ids: list[int], params: SamplingParams, **options: Any
                    ) -> Request:
        """Prepare and queue one request (caller on the engine's thread)."""
        return self.add_group(prompt_ids, [params], **options)[0]

    def abort(self, request_id: str) -> None:
        """Cancel a request (any thread); it is finished and its blocks freed at the next step."""
        self.admission.abort(request_id)

    # ---------------------------------------------------------------- the step
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.num_unfinished)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return an output for every request that changed."""
        self.kv.begin_step()
        changed = self.admission.leaving()
        self._retire()  # an aborted request must not be scheduled, even once
        sched = self.scheduler.schedule(self._proposals)
        if sched.rows:
            self.steps += 1
            began, start = time.monotonic(), time.perf_counter()
            changed += self._run(sched.rows)
            self.scheduler.costs.observe(sched.shape, time.perf_counter() - start)
            record_timelines(sched.rows, began, time.monotonic())
        elif self.kv.tier is not None:
            self.kv.tier.wait_for_reads(0.005)  # only disk reads to wait for: do not spin
        self._retire()
        self.admission.publish_quote()
        if self.kv_events is not None:
            self.kv_events.flush()
        return [output(r) for r in dict.fromkeys(changed)]

    def _publish_kv_events(self, storage: KVStorage) -> KVEvents | None:
        """With ``kv_events_endpoint``: the prefix cache's events, published from a
        thread of their own, starting with AllBlocksCleared (a restarted engine holds
        nothing a router may remember of it)."""
        c = self.config
        if c.kv_events_endpoint is None or self.kv.prefix is None:
            return None
        self.events_publisher = ZmqPublisher(c.kv_events_endpoint,
                                             c.kv_events_replay_endpoint, c.kv_events_topic)
        medium = "GPU" if getattr(getattr(storage, "pool", None), "is_cuda", False) else "CPU"
        events = KVEvents(self.events_publisher.publish, c.block_size, medium,
                          self.loras.name_of)
        events.cleared()
        events.flush()
        self.kv.prefix.events = events
        return events

    def output(self, req: Request) -> RequestOutput:
        return output(req)

    def _proposals(self) -> dict[Request, Proposal]:
        """Drafts of the decoding requests that speculate (the gate picks among them)."""
        out = {}
        rows = len(self.scheduler.running)
        for req in self.scheduler.running:
            spec = req.speculator
            if spec is None or req.remaining_prefill != 1 or not spec.due(rows):
                continue
            proposal = spec.propose()
            if proposal is None:
                spec.found_nothing()
            else:
                out[req] = proposal
        return out

    def _retire(self) -> None:
        """Release finished requests' blocks; their pending forks prefill alone."""
        for req in self.scheduler.remove_finished():
            self.admission.retired(req)
            if req.speculator is not None:
                self.spec_totals.add(req.speculator.stats)
            if req.lora is not None:
                self.loras.count_tokens(req.lora, req.num_output)

    def _run(self, rows: list[ScheduledRow]) -> list[Request]:
        self.runner.zero_new_blocks(self.kv.allocator)
        try:
            if self.recurrent is not None:
                self.recurrent.before(rows)
            logits = self.runner.execute(rows)
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            log.exception("forward pass failed")
            self.kv.file_snapshots(ok=False)
            for row in rows:
                finish(row.request, FinishReason.ERROR, f"forward pass failed: {e}")
            return [row.request for row in rows]
        rows, logits, scored = finite_rows(rows, logits, self.commit.fail)
        sampled, offset = [], 0
        for row in rows:
            if row.prompt_positions:
                n = len(row.prompt_positions)
                self.commit.prompt_logprobs(row, prompt_logprobs_of(row, logits[offset:offset + n]))
                offset += n
            if not row.samples:
                self.commit.computed(row)
            elif row.request.params.max_tokens == 0:
                self.commit.prompt_only(row)
                scored.append(row.request)
            else:
                sampled.append((row, logits[offset:offset + row.num_sampled]))
                offset += row.num_sampled
        changed = scored + self._verify(sampled)
        if self.recurrent is not None:
            self.recurrent.after(sampled)
        self.kv.file_snapshots()
        for row, row_logits in sampled:
            req = row.request
            if req.forks and req.num_output == 1 and req.finish_reason is not FinishReason.ERROR:
                changed += self._fork(req, row_logits[0])
        return changed

    def _verify(self, sampled: list[tuple[ScheduledRow, torch.Tensor]]) -> list[Request]:
        """Sample every row — plain rows and draft-verify rows alike, in one batch — and
        commit each request's tokens. A request's failure fails it alone."""
        batch: list[SampleRow] = []
        plans = []
        for row, row_logits in sampled:
            req = row.request
            try:
                positioned = processed(req, row_logits, row.draft)
            except Exception as e:
                self.commit.fail(req, e)
                continue
            plans.append((row, row_logits, len(batch)))
            batch += [SampleRow(req.sampler, row_logits[j], positioned[j], row.draft[:j],
                                req.num_output + j) for j in range(len(row.draft) + 1)]
        raw = stacked([row_logits for _, row_logits, _ in plans])
        results = sample_rows(batch, raw)
        drafting = any(row.draft for row, _ in sampled)
        topk = {}
        if drafting or self.steps % IDLE_FEED_EVERY == 0:
            self._feeds += 1
            topk = recycling_feed(plans, raw, self._feeds, FEED_ROWS if drafting else 1)
        for row, _, start in plans:
            try:
                self.commit.sampled(row, results[start:start + len(row.draft) + 1],
                                    topk.get(row.request))
            except InvalidDecodeState:
                raise  # an engine bug: fail loudly, not as one request's error
            except Exception as e:
                self.commit.fail(row.request, e)
        return [row.request for row, _ in sampled]

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[Request]:
        """Start the parent's siblings from its just-computed prompt and logits row."""
        siblings, parent.forks = parent.forks, []
        started, fallback = [], []
        for child in siblings:
            self.admission.forked(child)
            if self.kv.state_slots:  # a recurrent state is not shared: prefill on its own
                fallback.append(child)
                continue
            try:
                copy = self.kv.fork(parent, child)
            except OutOfBlocks:  # no block for its own copy: it prefills on its own
                fallback.append(child)
                continue
            if copy is not None:
                self.runner.zero_new_blocks(self.kv.allocator)  # before the copy fills one of them
                self.runner.kv.copy_block(*copy)
            self.scheduler.start_running(child)
            self._first_token(child, parent, logits)
            started.append(child)
        self.scheduler.requeue(fallback)
        return started

    def _first_token(self, req: Request, parent: Request, logits: torch.Tensor) -> None:
        """Sample and commit a forked sibling's first token from its parent's row."""
        try:
            token, lp = req.sampler.pick(logits, req.token_ids, req.num_output)
            self.commit.first_token(req, parent, token, lp)
        except InvalidDecodeState:
            raise
        except Exception as e:
            self.commit.fail(req, e)

    # ---------------------------------------------------------------- KV in and out
    def purge_cache(self, tenant: str | None) -> dict[str, int]:
        """Forget ``tenant``'s cached prefixes in RAM (engine thread); see
        :meth:`KVTransfer.purge`."""
        removed = self.transfer.purge(tenant_scope(self.intake.model_salt, tenant))
        if self.kv_events is not None:
            self.kv_events.flush()
        return removed

    def purge_disk(self, tenant: str | None) -> dict[str, int]:
        """Delete ``tenant``'s blocks from the KV disk tier (any thread, after
        :meth:`purge_cache`)."""
        return self.transfer.purge_disk(tenant_scope(self.intake.model_salt, tenant))

    def kv_fingerprint(self) -> bytes:
        return self.transfer.fingerprint()

    def export_prefix(self, tokens: Sequence[int], tenant: str | None = None,
                      lora: str | None = None) -> list:
        return self.transfer.export_prefix(tokens, tenant, self._adapter(lora, False))

    def cached_tokens(self, tokens: Sequence[int], tenant: str | None = None,
                      lora: str | None = None) -> int:
        return self.transfer.cached_tokens(tokens, tenant, self._adapter(lora, False))

    def import_prefix(self, records: Sequence, tenant: str | None = None,
                      lora: str | None = None, prompt: Sequence[int] = (),
                      first: int = 0) -> int:
        return self.transfer.import_prefix(records, tenant, self._adapter(lora, False),
                                           prompt, first)

    def close(self) -> None:
        """Finish writing the disk tier and the expert histogram (if any). The engine
        stays usable."""
        self.transfer.flush()
        if self.loaded.model.experts is not None:
            self.loaded.model.experts.flush()
        if self.kv_events is not None:
            self.kv_events.flush()

    # ---------------------------------------------------------------- introspection
    @property
    def stats(self) -> dict[str, int]:
        return {"prompt_tokens": self.commit.prompt_tokens,
                "generation_tokens": self.commit.generation_tokens, "steps": self.steps}

    def reset_counters(self) -> None:
        self.commit.prompt_tokens = self.commit.generation_tokens = self.steps = 0

    def metrics(self) -> dict[str, Any]:
        stats = snapshot(self.scheduler, self.kv, self.commit, self.steps, self.spec_totals,
                         self.transfer.metrics(), self.moe_metrics())
        for tenant, n in self.loras.resident_by_tenant().items():
            stats["tenants"].setdefault(tenant, dict.fromkeys(TENANT_COUNTS, 0))["adapters"] = n
        if self.loras.names():
            stats["lora"] = self.loras.metrics()
        return stats

    def load(self) -> dict[str, Any]:
        """This engine's load, as a disaggregating router weighs it (any thread)."""
        return load_summary(self.scheduler, self.transfer.storage.bytes_per_block)

    def moe_metrics(self) -> dict[str, Any] | None:
        return moe_metrics(self.loaded.model.experts)

