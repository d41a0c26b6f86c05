"""The front's side of the replicas: an engine thread whose engine is N Ray replicas.

:class:`ReplicaSet` offers what the server uses of an
:class:`~ember.engine.thread.EngineThread` (slots, submit, abort, drain, shutdown),
and :class:`FrontEngine` what it uses of an :class:`~ember.engine.engine.LLMEngine`
(tokenizer, chat template, limits, ``prepare``, metrics) — so the HTTP server, its
routes, auth, errors and streaming are the single-process server's own code.

``prepare`` dispatches the group to a replica (through the prefix-affinity router)
and waits for the replica's verdict, so a bad request gets exactly the error a
single-process server gives (the replica's ``engine.prepare`` decides). Outputs that
arrive before the server attaches its callback are buffered. A replica that dies
before the group streamed a token has the group re-dispatched (another replica, the
same request); after, the group's requests finish with an error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from ember.cluster.disagg import Planner
from ember.cluster.handoff import Handoffs
from ember.cluster.metrics import merge_into, replica_lines
from ember.cluster.protocol import GroupSpec, PurgeSpec, Verdict
from ember.cluster.remote import (
    DISPATCH_ATTEMPTS,
    Callback,
    RemoteGroup,
    RemoteRequest,
    replica_died,
)
from ember.cluster.router import RoutingView, view
from ember.cluster.wire import ReplicaStream, call_args, out_of_range, pack
from ember.config import EngineConfig
from ember.engine.admission import QueueFull
from ember.engine.embedding import EmbeddingError
from ember.engine.intake import SLO, InvalidRequest
from ember.engine.output import RequestOutput
from ember.engine.served import with_chat_template
from ember.engine.slots import QueuePlaces, Slot
from ember.engine.thread import EngineStopped
from ember.kv.prefix import extend_keys, tenant_salt
from ember.models.loader import LoadedModel
from ember.models.lora import LoRAAdapter, load_lora
from ember.sampling.params import SamplingParams
from ember.sampling.reasoning import ThinkingTags

log = logging.getLogger("ember.cluster")
DISPATCH_TIMEOUT_S = 60.0  # longest wait for a replica's verdict (none alive: 503)
PURGE_TIMEOUT_S = 60.0  # longest a replica may take to purge a tenant's prefixes
FRESH_STATS_WAIT_S = 3.0  # longest a metrics scrape waits for stats newer than the last change


class ReplicaSet:
    """The engine thread of a front: groups go to replicas through ``handle``."""

    def __init__(self, handle: Any, config: EngineConfig, replicas: int,
                 loaded: LoadedModel, planner: Planner | None = None,
                 imbalance: int = 4) -> None:
        self.handle = handle.options(stream=True, method_name="generate")
        self._purge = handle.options(method_name="purge_cache")
        self.config = config
        self.replicas = replicas
        self.view: RoutingView = view()
        self.planner = planner  # None: every request prefills where it decodes
        self.engine = FrontEngine(config, loaded, self)
        self._imbalance = imbalance  # the affinity router's, to predict where a request goes
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ember-replicas",
                                        daemon=True)
        self._lock = threading.Lock()
        self._places = QueuePlaces(config.limits_for)  # taken, not yet sent to a replica
        self._groups: dict[str, RemoteGroup] = {}  # request id -> its group
        self._stopping = False
        self._changed_at = 0.0  # wall time a stream last started or ended here

    @property
    def handoffs(self) -> Handoffs | None:
        """Disaggregated prefill, where a planner decides it (None: every request
        prefills where it decodes)."""
        if self.planner is None:
            return None
        return Handoffs(self.planner, self.view, self.config, self._imbalance, self._dispatch,
                        self._finish)

    def start(self) -> ReplicaSet:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    # ------------------------------------------------------------ the EngineThread API
    def slot(self, tenant: str | None = None) -> Slot:
        """A place in the front's queue, for ``tenant``: its ``max_queued`` counts its
        places here and its requests sent to replicas that have not streamed a token yet
        (waiting or prefilling: known here at once, not as of the replicas' stats)."""
        with self._lock:
            if self._stopping or not self.alive:
                raise EngineStopped("the replicas are not running")
            if self.queue_full():
                raise QueueFull(f"queue is full ({self._capacity()} requests across "
                                f"{self.replicas} replicas)")
            key = self._places.take(tenant, self._tenant_waiting)
        return Slot(self._submit, self._release_slot, key)

    def _submit(self, group: list[RemoteRequest], callback: Callback,
                key: str | None) -> list[str]:
        self._release_slot(key)
        self._loop.call_soon_threadsafe(group[0].group.attach, callback)
        return [r.request_id for r in group]

    def _release_slot(self, key: str | None) -> None:
        with self._lock:
            self._places.give_back(key)

    def _tenant_waiting(self, tenant: str) -> int:
        """Its groups submitted (a group being prepared holds its slot instead) that
        have not streamed yet."""
        groups = {id(g): g for g in list(self._groups.values())}.values()
        return sum(1 for g in groups if g.spec.tenant == tenant and g.callback is not None
                   and not g.streamed)

    def queue_full(self) -> bool:
        return self._queued() >= self._capacity()

    def quoted(self) -> tuple[None, dict[tuple[int, str], int]]:
        """No quote: each replica's engine checks what it is sent."""
        return None, {}

    def _capacity(self) -> int:
        return self.config.max_queue * self.replicas

    def _queued(self) -> int:
        waiting = sum(int(s.get("metrics", {}).get("requests_waiting", 0))
                      for s in self.view.snapshot().values())
        return waiting + self._places.count

    def dispatch(self, spec: GroupSpec) -> RemoteGroup:
        """Send ``spec`` to a replica; return once it accepted (raises what its
        ``engine.prepare`` raised). Called from a preparation thread."""
        return asyncio.run_coroutine_threadsafe(self._open(spec), self._loop).result()

    def abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is not None:
            self._cancel(group)

    def discard(self, group: Sequence[Any]) -> None:
        """Prepared requests that will never be submitted: stop them on their replica."""
        if group:
            self._cancel(group[0].group)  # a group's choices share one stream

    def abort_all(self) -> None:
        for group in list(self._groups.values()):
            self._cancel(group)

    def drain(self, timeout: float) -> bool:
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self._groups or self._places.count:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def shutdown(self, timeout: float | None = None) -> None:
        with self._lock:
            self._stopping = True
        self.abort_all()
        if self.alive:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    # ------------------------------------------------------------ the replicas' loop
    def _cancel(self, group: RemoteGroup) -> None:
        if group.task is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(group.task.cancel)

    async def _open(self, spec: GroupSpec) -> RemoteGroup:
        handoffs = self.handoffs
        group = RemoteGroup(spec, plan=handoffs.plan(spec) if handoffs else None)
        try:
            if group.plan is not None and group.plan.prefill is not None:
                assert handoffs is not None
                group.prefill, verdict = await handoffs.dispatch_prefill(group)
            else:
                group.stream, verdict = await self._dispatch(group)
        except BaseException:
            self._forget_prediction(spec.request_id)
            raise
        group.replica = verdict.replica  # the router placed it there (view.place)
        self._changed_at = time.time()
        for rid in spec.request_ids:
            self._groups[rid] = group
        group.task = asyncio.get_running_loop().create_task(self._pump(group))
        return group

    async def _dispatch(self, group: RemoteGroup) -> tuple[Any, Verdict]:
        """A stream from a replica that accepted the group's spec.

        A replica that died before answering, or refused with a full queue or a stopped
        engine, is avoided and another one asked, up to ``DISPATCH_ATTEMPTS`` tries per
        group over its life (failovers included): a request that kills every replica it
        touches must not crash-loop the deployment. No answer within
        ``DISPATCH_TIMEOUT_S`` (no replica alive) is a 503."""
        try:
            return await self._try_replicas(group)
        except BaseException:  # no replica has it: it counts on none
            self.view.unplace(group.spec.request_id)
            raise

    async def _try_replicas(self, group: RemoteGroup) -> tuple[Any, Verdict]:
        spec, refusal = group.spec, None
        param = out_of_range(spec)
        if param is not None:
            raise InvalidRequest(param, f"{param} is out of the 64-bit range the replicas take")
        while group.attempts < DISPATCH_ATTEMPTS:
            group.attempts += 1
            self.view.unplace(spec.request_id)  # the previous attempt's, if any
            stream = ReplicaStream(self.handle.remote(*call_args(spec)))
            try:
                verdict = await asyncio.wait_for(stream.__anext__(), DISPATCH_TIMEOUT_S)
            except TimeoutError:
                stream.cancel()
                raise EngineStopped(f"no replica answered within {DISPATCH_TIMEOUT_S:g} s") \
                    from None
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except Exception as e:
                if not replica_died(e):  # (a message one side cannot read: stop it)
                    stream.cancel()
                    log.error("dispatching %s failed: %r", spec.request_id, e)
                    raise EngineStopped("a replica failed to take the request") from None
                log.warning("replica died before answering %s: %r", spec.request_id, e)
                self.view.retries += 1
                continue
            if verdict.error is None:
                return stream, verdict
            if verdict.kind == "invalid":
                raise InvalidRequest(verdict.param, verdict.error)
            # this replica is full or stopping: another one may not be
            refusal = verdict
            spec.avoid = (*spec.avoid, verdict.replica)
            if len(set(spec.avoid)) >= self.replicas:
                break
        if refusal is not None and refusal.kind == "queue_full":
            raise QueueFull(refusal.error)
        raise EngineStopped(refusal.error if refusal is not None else
                            f"no replica could take the request in {DISPATCH_ATTEMPTS} tries")

    async def _pump(self, group: RemoteGroup) -> None:
        try:
            handoffs = self.handoffs
            if (group.prefill is not None and handoffs is not None
                    and not await handoffs.hand_over(group)):
                return
            while group.open_ids:
                try:
                    out = await group.stream.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:
                    if not replica_died(e):
                        raise
                    if not await self._failover(group, e):
                        return
                    continue
                out = group.deliver(out)
                if out.finished and out.request_id == group.spec.request_id:
                    self._count_cached(group.spec.request_id, out.cached_tokens)
        except asyncio.CancelledError:  # the client left: both replicas let it go
            for stream in (group.prefill, group.stream):
                if stream is not None:
                    stream.cancel()
            self._finish(group, "abort", None)
        except Exception as e:
            log.exception("stream of %s failed: %r", group.spec.request_id, e)
            for stream in (group.prefill, group.stream):  # the replica would go on
                if stream is not None:
                    stream.cancel()
            self._finish(group, "error", "the replica stream failed")
        finally:
            self.view.unplace(group.spec.request_id)
            self._changed_at = time.time()
            self._forget_prediction(group.spec.request_id)
            for rid in group.spec.request_ids:
                self._groups.pop(rid, None)

    async def _failover(self, group: RemoteGroup, error: BaseException) -> bool:
        """The replica died mid-stream: re-dispatch if nothing reached the client yet
        (no token, no finished choice), else end the group with an error. Whether the
        pump goes on."""
        log.warning("replica %s died serving %s: %r", group.replica, group.spec.request_id,
                    error)
        self.view.replica_failures += 1
        if group.streamed:
            self._finish(group, "error", "the replica serving this request died")
            return False
        self.view.retries += 1
        group.spec.avoid = (*group.spec.avoid, group.replica)
        try:
            group.stream, verdict = await self._dispatch(group)
        except Exception:
            self._finish(group, "error", "the replica serving this request died and no "
                         "other could take over")
            return False
        group.replica = verdict.replica
        group.buffer.clear()  # nothing in it reached anyone: the new replica starts afresh
        group.handed_tokens = 0  # the handoff went to the replica that died
        group.latest.clear()
        return True

    def _finish(self, group: RemoteGroup, reason: str, error: str | None) -> None:
        """End the group's open requests with ``reason`` (they get no further outputs)."""
        for rid in group.open_ids:
            last = group.latest.get(rid)
            group.deliver(RequestOutput(
                request_id=rid, text=last.text if last else "",
                token_ids=list(last.token_ids) if last else [],
                prompt_tokens=len(group.spec.prompt_ids),
                cached_tokens=last.cached_tokens if last else 0, finished=True,
                finish_reason=reason, error=error))

    def _count_cached(self, request_id: str, cached: int) -> None:
        v = self.view
        with v.lock:
            blocks = v.predicted_blocks.pop(request_id, None)
            if blocks is not None:
                v.predicted_tokens += blocks * self.config.block_size
                v.actual_tokens += cached

    def _forget_prediction(self, request_id: str) -> None:
        with self.view.lock:
            self.view.predicted_blocks.pop(request_id, None)

    # ------------------------------------------------------------ metrics
    def merged_metrics(self) -> dict[str, Any]:
        """The replicas' engine metrics summed, as of their routing stats: taken after
        the last stream started or ended here before this call, where such stats arrive
        within ``FRESH_STATS_WAIT_S`` (so a scrape reflects the requests it follows)."""
        self._await_fresh_stats(self._changed_at)
        total: dict[str, Any] = {}
        for stats in self.view.snapshot().values():
            merge_into(total, stats.get("metrics", {}))
        return total

    def _await_fresh_stats(self, since: float) -> None:
        deadline = time.monotonic() + FRESH_STATS_WAIT_S
        while time.monotonic() < deadline:
            stats = self.view.snapshot().values()
            if stats and all(s.get("taken_at", 0.0) >= since for s in stats):
                return
            time.sleep(0.02)

    def purge_cache(self, tenant: str) -> dict[str, int]:
        """Forget ``tenant``'s cached prefixes on every replica, one after another
        (each call pinned to its replica by the router); the totals removed. A replica
        that does not answer makes it a 503: the purge is then incomplete."""
        replicas = sorted(self.view.snapshot())
        if len(replicas) < self.replicas:
            raise EngineStopped(f"{len(replicas)} of {self.replicas} replicas are known "
                                "to the router; purge again once all are up")
        total: dict[str, int] = {}
        for replica in replicas:
            try:
                got = self._purge.remote(pack(PurgeSpec(tenant, replica))).result(
                    timeout_s=PURGE_TIMEOUT_S)
            except Exception as e:
                raise EngineStopped(f"replica {replica} did not purge tenant {tenant!r} "
                                    f"({type(e).__name__}); purge again") from None
            if got.get("replica") != replica:
                raise EngineStopped(f"the purge meant for replica {replica} reached "
                                    f"{got.get('replica')}; purge again")
            for key, value in got.items():
                if key != "replica":
                    total[key] = total.get(key, 0) + int(value)
        return {**total, "replicas": len(replicas)}

    def embed(self, inputs: list[list[int]], scores: bool = False) -> Any:
        raise EmbeddingError("embeddings and rerank are not served with --replicas: run a "
                             "single-engine server for them", "model")

    def cancel_embed(self, result: Any) -> None:
        pass  # no embedding is ever started here (embed refuses)

    def metric_lines(self) -> list[str]:
        """Per-replica and router metrics, in the Prometheus text format."""
        return replica_lines(self.view, self.planner)


class FrontEngine:
    """What the server reads of an engine, for a front whose engines are replicas."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, replicas: ReplicaSet) -> None:
        if config.chat_template is not None:
            loaded = with_chat_template(loaded, config.chat_template)
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        source = loaded.chat_template.source if loaded.chat_template else None
        self.thinking_tags = ThinkingTags.of_template(source)
        context = loaded.config.context_length
        self.max_model_len = min(config.max_model_len or context, context)
        self.model_salt = loaded.fingerprint().encode()
        self._replicas = replicas
        self._ids = itertools.count()
        self._prefix = f"rq-{secrets.token_hex(4)}"
        # LoRA adapters by name: (path, identity), checked here against the base; each
        # replica loads the file when a request first needs it (GroupSpec.lora)
        self.loras: dict[str, tuple[str, bytes]] = {}

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Check the adapter at ``path`` against the base and record its identity (the
        replicas' copies must have it); the tensors are not kept here."""
        adapter = load_lora(path, name, self.loaded.config, self.config.max_lora_rank)
        self.loras[name] = (str(path), adapter.identity)
        return adapter

    def unload_lora(self, name: str) -> None:
        """New requests may no longer name it; the replicas evict it when it is the
        least recently used (running requests finish with it)."""
        if self.loras.pop(name, None) is None:
            raise KeyError(f"no LoRA adapter {name!r} is loaded")

    def prepare(self, prompt_ids: list[int], params: SamplingParams | Sequence[SamplingParams],
                *, request_id: str | None = None, tenant: str | None = None,
                processors: Sequence[Any] = (), priority: int = 0, slo: SLO | None = None,
                weight: float = 1.0, arrival: float | None = None,
                references: Sequence[str] = (), lora: str | None = None
                ) -> list[RemoteRequest]:
        """Dispatch one prompt's choices to a replica (see the module docstring)."""
        if processors:
            raise InvalidRequest("processors", "logit processors cannot cross to a replica")
        adapter = None
        if lora is not None:
            if lora not in self.loras:
                raise InvalidRequest("lora", f"no LoRA adapter {lora!r} is loaded")
            adapter = (lora, *self.loras[lora])
        choices = [params] if isinstance(params, SamplingParams) else list(params)
        spec = GroupSpec(
            request_id=request_id or f"{self._prefix}-{next(self._ids)}",
            prompt_ids=list(prompt_ids), params=choices, tenant=tenant or "",
            priority=priority, slo=slo, weight=weight,
            waited=0.0 if arrival is None else max(0.0, time.monotonic() - arrival),
            references=tuple(references), lora=adapter,
            keys=self.prefix_keys(prompt_ids, tenant, adapter[2] if adapter else None))
        group = self._replicas.dispatch(spec)
        return [RemoteRequest(rid, len(spec.prompt_ids), slo.ttft if slo else None,
                              slo.tpot if slo else None, group) for rid in spec.request_ids]

    def prefix_keys(self, prompt_ids: Sequence[int], tenant: str | None,
                    adapter: bytes | None = None) -> list[bytes]:
        """The chain keys the replicas' prefix caches give this prompt's full blocks (for
        ``tenant``, with the LoRA adapter whose identity is ``adapter``, if any)."""
        if not self.config.enable_prefix_caching:
            return []
        keys: list[bytes] = []
        try:
            extend_keys(keys, tenant_salt(self.model_salt, tenant, adapter), list(prompt_ids),
                        self.config.block_size)
        except (OverflowError, TypeError, ValueError):
            return []  # not valid token ids: the replica will say so
        return keys

    def metrics(self) -> dict[str, Any]:
        return self._replicas.merged_metrics()
