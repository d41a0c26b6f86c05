"""Intake: a request validated and built before it is queued, on any thread.

:meth:`Intake.prepare` checks a prompt and its parameters, compiles its grammar
(cached), and builds its state: sampler and processors, block table, detokenizer,
stops, draft sources. It touches nothing the engine thread owns — the server runs it
off that thread, so the step loop never waits for a grammar or a reference text. A
bad request fails here with :class:`InvalidRequest` naming the parameter, before
anything is queued.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ember.config import EngineConfig
from ember.engine.costs import StepShape
from ember.engine.request import Request
from ember.engine.scheduler import SEAT_MARGIN
from ember.engine.stops import Stops
from ember.errors import EmberError
from ember.kv.blocks import blocks_for
from ember.kv.manager import KVCacheManager
from ember.kv.prefix import tenant_salt
from ember.models.loader import LoadedModel
from ember.models.lora import LoRAAdapter
from ember.sampling.constraints import GrammarCompiler, GrammarError
from ember.sampling.params import SamplingParams
from ember.sampling.reasoning import ThinkingBudget, ThinkingTags, answer_reserve, open_in_prompt
from ember.sampling.sampler import LogitProcessor, Sampler, can_speculate
from ember.spec.index import RecyclingTable, SuffixAutomaton
from ember.spec.speculator import Speculator
from ember.tokenizer import IncrementalDetokenizer

REFERENCE_CACHE = 32  # frozen reference indexes kept for reuse across requests


class InvalidRequest(EmberError, ValueError):
    """A request the engine cannot serve as given; ``param`` names the culprit and
    ``value`` (where there is one) what was given. Where the message names the
    parameter it writes ``{param}``, so a caller that calls it otherwise (the HTTP
    API's ``max_completion_tokens``) can say so: :meth:`describe`."""

    def __init__(self, param: str, message: str, value: object = None) -> None:
        self.param = param
        self.value = value
        self.template = message
        super().__init__(self.describe())

    def describe(self, name: str | None = None) -> str:
        """The message, naming the parameter ``name`` (default: the engine's name)."""
        return self.template.replace("{param}", name or self.param)


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
                                                    f"got {value!r}", value)


class Intake:
    """Builds requests for one engine; every method is safe on any thread."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, kv: KVCacheManager,
                 max_model_len: int, predict: Callable[[StepShape], float]) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.kv = kv
        self.max_model_len = max_model_len
        self._predict = predict  # the fastest the step-cost model says a step may take
        self.model_salt = loaded.fingerprint().encode()
        source = loaded.chat_template.source if loaded.chat_template else None
        self.thinking_tags = ThinkingTags.of_template(source)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the caches below
        self._grammars: GrammarCompiler | None = None
        self._references: OrderedDict[str, SuffixAutomaton] = OrderedDict()
        self._recycling_tables: dict[str, RecyclingTable] = {}
        self._shared_references = [self._reference(t) for t in config.spec_references]

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (built on first use)."""
        if self._grammars is None:
            with self._lock:
                if self._grammars is None:
                    self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars

    def salt_for(self, tenant: str | None, lora: LoRAAdapter | None = None) -> bytes:
        """Prefix-cache salt: model fingerprint + tenant (+ the LoRA adapter's identity:
        no prefix is shared across adapters). Never from request content."""
        return tenant_salt(self.model_salt, tenant, None if lora is None else lora.identity)

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
        lora: LoRAAdapter | None = None,
    ) -> list[Request]:
        """Validate and build the requests for one prompt: one per ``params`` (n choices).

        ``tenant`` scopes the prefix cache and is the fair-share account; ``weight`` is
        that tenant's share relative to others; ``priority`` orders service (lower
        first); ``references`` are texts its drafts may copy from (speculation; the
        server's ``--spec-ref`` texts always are); ``slo`` sets latency objectives (see
        :class:`SLO`); ``arrival`` is when the request arrived (``time.monotonic()``;
        default: now), which its TTFT counts from — the server passes the moment it
        started reading the request. ``lora``: the adapter its tokens run with (its
        identity joins the prefix-cache salt: no prefix is shared across adapters).
        """
        if not self.loaded.config.causal:
            raise InvalidRequest("model", f"{{param}}: {self.loaded.name} is an embedding "
                                 f"model ({self.loaded.config.architecture}): it embeds "
                                 "(/v1/embeddings) and generates nothing")
        choices = [params] if isinstance(params, SamplingParams) else list(params)
        self._check_options(choices, priority, weight, processors)
        window = self.window_for(tenant)
        for p in choices:
            prompt_ids = self._validate_prompt(prompt_ids, p, tenant, window)
        if slo is not None and slo.tpot is not None:
            self._check_tpot_attainable(slo.tpot, len(prompt_ids), len(choices))
        group = []
        for j, p in enumerate(choices):
            procs = self._processors(prompt_ids, p, processors)
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
                stops=Stops.of(p, self.tokenizer.eog_ids, window),
                salt=self.salt_for(tenant, lora),
                lora=lora,
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

    # ------------------------------------------------------------ validation
    def _check_options(self, choices: list[SamplingParams], priority: int, weight: float,
                       processors: Sequence[LogitProcessor]) -> None:
        if not 1 <= len(choices) <= self.config.max_num_seqs:
            raise InvalidRequest("n", f"n must be between 1 and max_num_seqs "
                                      f"({self.config.max_num_seqs}), got {len(choices)}",
                                 len(choices))
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest("priority", f"must be an integer, got {priority!r}", priority)
        if not (isinstance(weight, int | float) and weight > 0):
            raise InvalidRequest("weight", f"must be a positive number, got {weight!r}", weight)
        if processors and len(choices) > 1:
            raise InvalidRequest("processors", "processors hold per-request state; pass them "
                                               "for a single choice only")

    def window_for(self, tenant: str | None) -> int:
        """The most positions one request of ``tenant`` may hold: the context window,
        or less where the tenant's ``kv_share`` of the pool is smaller (a request with
        no ``max_tokens`` stops there, with finish reason ``length``)."""
        cap = self.config.limits_for(tenant).share("kv_share", self.kv.num_blocks)
        return self.max_model_len if cap is None else min(self.max_model_len,
                                                          cap * self.kv.block_size)

    def _validate_prompt(self, prompt_ids: list[int], params: SamplingParams,
                         tenant: str | None, window: int) -> list[int]:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary "
                                           f"[0, {vocab})", bad)
        wanted = len(prompt_ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len and params.max_tokens is None:
            raise InvalidRequest(
                "prompt", f"the prompt ({len(prompt_ids)} tokens) leaves no room for a reply "
                          f"in the context window of {self.max_model_len} tokens")
        if wanted > self.max_model_len:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + {{param}} ({params.max_tokens}) = "
                f"{wanted} exceeds the context window of {self.max_model_len} tokens",
                params.max_tokens)
        blocks = blocks_for(wanted, self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise InvalidRequest(
                "max_tokens", f"request needs {blocks} KV blocks, the pool has "
                              f"{self.kv.num_blocks}", params.max_tokens)
        if wanted > window:
            share = self.config.limits_for(tenant).kv_share
            raise InvalidRequest(
                "max_tokens", f"prompt ({len(prompt_ids)} tokens) + {{param}} "
                              f"({params.max_tokens}) needs {blocks} KV blocks, more than "
                              f"this tenant's limit kv_share={share:g} of the pool allows "
                              f"({window // self.kv.block_size} blocks, {window} tokens)",
                params.max_tokens)
        return prompt_ids

    def _check_tpot_attainable(self, tpot: float, context: int, rows: int) -> None:
        """Refuse a TPOT objective that no schedule can meet: the request's own decode
        step, with nothing else running, is predicted to take longer. (Admission only
        seats a stream whose step fits its objective, so such a request would otherwise
        wait for ever.)"""
        alone = self._predict(StepShape(rows, rows, context, decode_rows=rows, logits=rows))
        if alone > SEAT_MARGIN * tpot:
            raise InvalidRequest("slo.tpot_ms", f"a decode step of this request alone is "
                                 f"predicted to take {alone * 1e3:.1f} ms on this server, "
                                 f"so {tpot * 1e3:g} ms per output token cannot be met",
                                 tpot * 1e3)

    # ------------------------------------------------------------ per-request state
    def _processors(self, prompt_ids: list[int], p: SamplingParams,
                    given: Sequence[LogitProcessor]) -> list[LogitProcessor]:
        """The caller's processors, then the grammar's and the reasoning budget's."""
        procs = list(given)
        if p.structured is not None:
            try:
                procs.append(self.grammars.processor(p.structured))
            except GrammarError as e:
                raise InvalidRequest("structured", "invalid {param}: " + str(e)) from None
        if p.thinking_budget is not None:
            procs.append(self._thinking_budget(prompt_ids, p))
        return procs

    def _thinking_budget(self, prompt_ids: list[int], p: SamplingParams) -> ThinkingBudget:
        """The processor ending the reasoning: after ``p.thinking_budget`` tokens, and
        always early enough to leave the answer its share of ``max_tokens``."""
        if self.thinking_tags is None:
            raise InvalidRequest("thinking_budget", "the model's chat template has no "
                                 "thinking tags", p.thinking_budget)
        tags = self.thinking_tags
        opened = open_in_prompt(self.tokenizer.decode(prompt_ids[-16:]), tags)
        if p.structured is not None:  # what follows the reasoning is the grammar's
            tags = dataclasses.replace(tags, forced_close=tags.close)
        proc = ThinkingBudget(self.tokenizer, tags, p.thinking_budget or 0, opened)
        if p.max_tokens is not None:
            proc.budget = min(proc.budget, max(0, p.max_tokens - len(proc.close_ids)
                                               - answer_reserve(p.max_tokens)))
        return proc

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
