"""A group of requests as the front sees it while a replica serves it: its stream, the
outputs buffered until the server attaches, what reached the client (after which a
replica's death cannot be retried)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember.cluster.disagg import Plan
from ember.cluster.protocol import GroupSpec
from ember.engine.output import RequestOutput

Callback = Callable[[RequestOutput], None]
DISPATCH_ATTEMPTS = 3  # dispatches one group may take over its life (failovers included)


@dataclass
class RemoteRequest:
    """What the server reads of a prepared request (one choice of a group)."""

    request_id: str
    num_prompt: int
    slo_ttft: float | None
    slo_tpot: float | None
    group: RemoteGroup


@dataclass
class RemoteGroup:
    """One dispatched group; its state lives on the ReplicaSet's event loop."""

    spec: GroupSpec
    replica: str = ""
    callback: Callback | None = None
    buffer: list[RequestOutput] = field(default_factory=list)
    latest: dict[str, RequestOutput] = field(default_factory=dict)
    streamed: bool = False  # a token or a finished choice came: a death cannot be retried
    task: asyncio.Task | None = None
    stream: Any = None  # the live replica stream
    attempts: int = 0  # dispatches so far (DISPATCH_ATTEMPTS at most)
    plan: Plan | None = None  # disaggregated: where it prefills and where it decodes
    prefill: Any = None  # the prefill replica's stream, until it handed the KV over
    prefill_sent: float = 0.0  # when the prefill was dispatched (monotonic)
    handed_tokens: int = 0  # prompt tokens the handoff added to the decoder's cache

    def deliver(self, out: RequestOutput) -> RequestOutput:
        """Pass ``out`` on (to the client, or the buffer until one attaches); what was
        passed."""
        if self.handed_tokens and out.cached_tokens:
            # computed for this request on the prefill replica: not a cache hit
            out = dataclasses.replace(
                out, cached_tokens=max(0, out.cached_tokens - self.handed_tokens))
        self.streamed = self.streamed or bool(out.token_ids) or out.finished
        self.latest[out.request_id] = out
        if self.callback is None:
            self.buffer.append(out)
        else:
            self.callback(out)
        return out

    def attach(self, callback: Callback) -> None:
        self.callback = callback
        for out in self.buffer:
            callback(out)
        self.buffer.clear()

    @property
    def open_ids(self) -> list[str]:
        return [r for r in self.spec.request_ids
                if r not in self.latest or not self.latest[r].finished]


def replica_died(e: BaseException) -> bool:
    """Whether ``e`` says the replica serving a stream went away (retryable)."""
    try:
        from ray.exceptions import ActorDiedError
    except ImportError:  # pragma: no cover
        return False
    # not ActorUnavailableError: the replica may still run the request (Ray says so), and
    # a retry could run it twice
    return isinstance(e, ActorDiedError)
