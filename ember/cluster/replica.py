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
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ember.cluster.protocol import GroupSpec, PurgeSpec, Verdict
from ember.config import EngineConfig
from ember.engine.admission import QueueFull
from ember.engine.engine import LLMEngine
from ember.engine.intake import InvalidRequest
from ember.engine.output import RequestOutput
from ember.engine.thread import EngineStopped, EngineThread
from ember.models.lora import LoRAError


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
    def __init__(self, config: EngineConfig) -> None:
        _loopback_serve_grpc()
        self.engine = LLMEngine(config)
        self.thread = EngineThread(self.engine).start()
        self.replica = _replica_id()

    async def generate(self, spec: GroupSpec) -> AsyncIterator[Verdict | RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        submitting = loop.run_in_executor(None, self._submit, spec, deliver)
        try:  # prepare compiles grammars: off the replica's event loop
            ids = await asyncio.shield(submitting)
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
        yield Verdict(self.replica)
        open_ids = set(ids)
        try:
            while open_ids:
                out = await queue.get()
                if out.finished:
                    open_ids.discard(out.request_id)
                yield out
        finally:  # cancelled (the front's client went away) or done
            for rid in open_ids:
                self.thread.abort(rid)

    def _abort_when_submitted(self, submitted: asyncio.Future) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            for rid in submitted.result():
                self.thread.abort(rid)

    def _submit(self, spec: GroupSpec, deliver: Any) -> list[str]:
        with self.thread.slot() as slot:
            lora = None
            if spec.lora is not None:
                lora, path, identity = spec.lora
                try:
                    self.engine.loras.ensure(lora, path, identity)
                except LoRAError as e:
                    raise InvalidRequest("model", str(e)) from None
            group = self.engine.prepare(
                spec.prompt_ids, spec.params, request_id=spec.request_id, tenant=spec.tenant,
                priority=spec.priority, slo=spec.slo, weight=spec.weight,
                arrival=time.monotonic() - spec.waited, references=spec.references, lora=lora)
            return slot.submit(group, deliver)

    def purge_cache(self, spec: PurgeSpec) -> dict[str, Any]:
        """Forget a tenant's cached prefixes here (RAM and disk tier); what went."""
        return {"replica": self.replica, **self.thread.purge_cache(spec.tenant)}

    def record_routing_stats(self) -> dict[str, Any]:
        """The router's view of this replica (Ray Serve calls it periodically)."""
        prefix = self.engine.kv.prefix
        keys = prefix.keys() if prefix is not None else []
        return {"keys": keys, "metrics": self.engine.metrics(), "pid": os.getpid(),
                "taken_at": time.time()}

    def check_health(self) -> None:
        if not self.thread.alive:
            raise RuntimeError(f"the engine thread stopped: {self.thread.error!r}")

    def __del__(self) -> None:
        thread = getattr(self, "thread", None)
        if thread is not None and thread.alive:
            thread.shutdown(timeout=5)
