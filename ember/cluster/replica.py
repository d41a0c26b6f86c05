"""One ember engine as a Ray Serve deployment replica.

Each replica owns an :class:`~ember.engine.thread.EngineThread` (the same one the
single-process server runs) and answers :meth:`EmberReplica.generate` with a stream:
first a :class:`~ember.cluster.protocol.Verdict` (what ``engine.prepare`` said), then
the group's :class:`~ember.engine.engine.RequestOutput` objects. Cancelling the stream
(the client went away) aborts the group in the engine. ``record_routing_stats`` is
Ray Serve's hook for the router's view: the keys in this replica's prefix cache and
its engine metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ember.cluster import wire
from ember.cluster.protocol import GroupSpec, Handoff, PurgeSpec, Verdict
from ember.config import EngineConfig
from ember.engine.admission import QueueFull
from ember.engine.engine import LLMEngine
from ember.engine.intake import InvalidRequest
from ember.engine.output import RequestOutput
from ember.engine.thread import EngineStopped, EngineThread
from ember.kv.disk import CorruptBlock, decode, encode
from ember.kv.tier import blocks_of
from ember.models.loader import LoadedModel
from ember.models.lora import LoRAError
from ember.sampling.params import SamplingParams

HANDOFF_FETCH_TIMEOUT_S = 30.0  # longest a decoding replica waits for handed-over blocks


def _publish(blocks: list[bytes]) -> Any:
    """Blocks for another replica: into Ray's object store (the reference travels, the
    bytes go replica to replica), or as they are outside Ray."""
    try:
        import ray
    except ImportError:  # pragma: no cover - the replicas need ray
        return blocks
    return ray.put(blocks) if ray.is_initialized() else blocks


def _fetch(published: Any) -> list[bytes]:
    if isinstance(published, list):
        return published
    import ray

    return ray.get(published, timeout=HANDOFF_FETCH_TIMEOUT_S)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Ray Serve (tests drive the class directly)
        return f"pid-{os.getpid()}"


def _loopback_serve_grpc() -> None:
    """In ember's private single-machine Ray (loopback only: see
    ``deploy._token_auth_unless_joining``), make this replica's inter-deployment gRPC
    server listen on loopback too: Ray Serve 2.60 binds it to every interface
    (``[::]:0``, hard-coded in its replica), after the deployment's constructor runs."""
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        return  # a cluster ember joined: its listeners are its operator's
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return
    add = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add is None or getattr(add, "ember_loopback", False):
        return

    def loopback(server: Any, address: str) -> Any:
        return add(server, address.replace("[::]:", "127.0.0.1:", 1))

    loopback.ember_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = loopback


class EmberReplica:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        _loopback_serve_grpc()
        self.engine = LLMEngine(config, loaded)
        self.thread = EngineThread(self.engine).start()
        self.replica = _replica_id()

    async def generate(self, message: bytes, blocks: list[Any] | None = None
                       ) -> AsyncIterator[bytes | tuple[bytes, Any]]:
        """For a :class:`GroupSpec` (with its handoff's ``blocks`` beside it, as
        :func:`wire.call_args` sends them): the group's verdict, then its outputs; for a
        prefill spec (``spec.prefill``), the verdict and then the :class:`Handoff` of
        the prompt's KV. Each item as :func:`wire.stream_item` makes it."""
        spec = wire.received_spec(message, blocks)
        async for item in self._generate(spec):
            yield wire.stream_item(item)

    async def _generate(self, spec: GroupSpec) -> AsyncIterator[Verdict | RequestOutput | Handoff]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(out: RequestOutput) -> None:
            # an output after the caller's loop closed (it left mid-request, the engine
            # was still aborting): nobody is waiting for it
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, out)

        began = time.monotonic()
        # prepare compiles grammars and a handoff is checked block by block: off the
        # replica's event loop
        submitting = loop.run_in_executor(None, self._submit, spec, deliver)
        try:
            ids, imported = await asyncio.shield(submitting)
        except asyncio.CancelledError:  # the front gave up: stop what is submitted anyway
            submitting.add_done_callback(self._abort_when_submitted)
            raise
        except InvalidRequest as e:
            yield Verdict(self.replica, str(e), "invalid", e.param)
            return
        except QueueFull as e:
            yield Verdict(self.replica, str(e), "queue_full")
            return
        except EngineStopped as e:
            yield Verdict(self.replica, str(e), "stopped")
            return
        yield Verdict(self.replica, imported=imported)
        open_ids, last = set(ids), None
        try:
            while open_ids:
                out = await queue.get()
                if out.finished:
                    open_ids.discard(out.request_id)
                if spec.prefill:
                    last = out
                else:
                    yield out
        finally:  # cancelled (the front's client went away) or done
            for rid in open_ids:
                self.thread.abort(rid)
        if spec.prefill:
            yield await loop.run_in_executor(None, self._export, spec, last,
                                             time.monotonic() - began)

    def _abort_when_submitted(self, submitted: asyncio.Future) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            for rid in submitted.result()[0]:
                self.thread.abort(rid)

    def _submit(self, spec: GroupSpec, deliver: Any) -> tuple[list[str], dict | None]:
        with self.thread.slot() as slot:
            lora = self._adapter(spec)
            imported = self._import(spec, lora) if spec.handoff is not None else None
            # the prefill half validates all but the TPOT objective: the decoder checks
            # that against its own step costs (a replica that only prefills has never
            # timed a decode step)
            slo = replace(spec.slo, tpot=None) if spec.prefill and spec.slo else spec.slo
            group = self.engine.prepare(
                spec.prompt_ids, spec.params, request_id=spec.request_id, tenant=spec.tenant,
                priority=spec.priority, slo=slo, weight=spec.weight,
                arrival=time.monotonic() - spec.waited, references=spec.references, lora=lora)
            if spec.prefill:  # validated as the whole request; run its prompt only
                self.thread.discard(group)
                group = self.engine.prepare(
                    spec.prompt_ids[:-1], SamplingParams(max_tokens=0, speculation=False),
                    request_id=f"{spec.request_id}-prefill", tenant=spec.tenant,
                    priority=spec.priority, arrival=time.monotonic() - spec.waited,
                    lora=lora)
            return slot.submit(group, deliver), imported

    def _adapter(self, spec: GroupSpec) -> str | None:
        if spec.lora is None:
            return None
        lora, path, identity = spec.lora
        try:
            self.engine.loras.ensure(lora, path, identity)
        except LoRAError as e:
            raise InvalidRequest("model", str(e)) from None
        return lora

    # ------------------------------------------------------------ KV handoff
    def _export(self, spec: GroupSpec, last: RequestOutput | None, seconds: float) -> Handoff:
        """The prefilled prompt's cached blocks, encoded and published for the decoder."""
        if last is None or last.finish_reason in ("error", "abort", "rejected"):
            why = last.error if last is not None and last.error else "the prefill did not finish"
            return Handoff(None, 0, 0, self.replica, seconds, error=why)
        began = time.monotonic()
        lora = spec.lora[0] if spec.lora is not None else None
        prompt = spec.prompt_ids[:-1]
        records = self.thread.call(lambda e: e.export_prefix(prompt, spec.tenant, lora))
        chain = blocks_of(records)
        first = min(spec.handoff_from, len(chain))  # the decoder holds blocks before it
        fp = self.engine.kv_fingerprint()
        # a hybrid's state snapshot after the last block travels with the blocks
        blocks = [encode(fp, rec) for rec in (*chain[first:], *records[len(chain):])]
        nbytes = sum(map(len, blocks))
        return Handoff(_publish(blocks), sum(len(r.tokens) for r in chain), nbytes,
                       self.replica, seconds, time.monotonic() - began, first=first)

    def _import(self, spec: GroupSpec, lora: str | None) -> dict[str, Any]:
        """Take the spec's handoff into the prefix cache, each block verified (checksum,
        fingerprint, then tenant salt, chain keys and tokens); what was taken. Whatever
        does not verify or arrive is recomputed: the request runs either way."""
        h = spec.handoff
        assert h is not None
        began = time.monotonic()
        report: dict[str, Any] = {"offered": h.tokens, "tokens": 0, "bytes": 0, "seconds": 0.0,
                                  "error": h.error}
        if h.error or not h.tokens:
            return report
        try:
            blocks = _fetch(h.blocks)
        except Exception as e:  # the prefill replica died, or the store lost the object
            report["error"] = f"fetching the blocks failed: {type(e).__name__}"
            return report
        fp, records = self.engine.kv_fingerprint(), []
        for i, data in enumerate(blocks):
            try:
                rec = decode(data, fp)
            except CorruptBlock as e:
                report["error"] = f"block {i} is corrupt ({e})"
                break
            if rec is None:
                report["error"] = f"block {i} is for another model, KV dtype or layout"
                break
            records.append(rec)
        report["bytes"] = sum(len(r.payload) for r in records)
        bs = self.engine.config.block_size
        prompt = spec.prompt_ids[:(h.first + len(blocks_of(records))) * bs]

        def take(e: LLMEngine) -> tuple[int, int]:
            return (e.cached_tokens(prompt, spec.tenant, lora),
                    e.import_prefix(records, spec.tenant, lora, prompt, h.first))

        already, tokens = self.thread.call(take)
        if tokens < len(prompt) and not report["error"]:
            report["error"] = ("a block did not match the request's tenant, adapter or prompt"
                               if already >= h.first * bs else
                               "the blocks before the handoff were no longer cached here")
        # loaded: what the handoff added (the rest was cached here already); the client's
        # usage counts those tokens as computed for it, not as a cache hit
        report.update(tokens=tokens, loaded=max(0, tokens - already),
                      seconds=time.monotonic() - began)
        return report

    def purge_cache(self, message: bytes) -> dict[str, Any]:
        """Forget a tenant's cached prefixes here (RAM and disk tier), as the
        :class:`PurgeSpec` in ``message`` asks; what went."""
        spec = wire.unpack(message, PurgeSpec)
        return {"replica": self.replica, **self.thread.purge_cache(spec.tenant)}

    def record_routing_stats(self) -> dict[str, Any]:
        """The router's view of this replica (Ray Serve calls it periodically)."""
        prefix = self.engine.kv.prefix
        keys = prefix.keys() if prefix is not None else []
        return {"keys": keys, "metrics": self.engine.metrics(), "load": self.engine.load(),
                "pid": os.getpid(), "taken_at": time.time()}

    def check_health(self) -> None:
        if not self.thread.alive:
            raise RuntimeError(f"the engine thread stopped: {self.thread.error!r}")

    def __del__(self) -> None:
        thread = getattr(self, "thread", None)
        if thread is not None and thread.alive:
            thread.shutdown(timeout=5)
