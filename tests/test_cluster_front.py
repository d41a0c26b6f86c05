"""The front's replica set against a scripted stand-in for the Ray Serve handle: what
each replica answers (a verdict, outputs, or death) is fixed per dispatch, so every
failure path runs deterministically, without Ray."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402

from ember.cluster import front as front_mod  # noqa: E402
from ember.cluster import wire  # noqa: E402
from ember.cluster.disagg import Planner  # noqa: E402
from ember.cluster.front import ReplicaSet  # noqa: E402
from ember.cluster.protocol import Handoff, PurgeSpec, Verdict  # noqa: E402
from ember.cluster.remote import DISPATCH_ATTEMPTS  # noqa: E402
from ember.config import EngineConfig  # noqa: E402
from ember.engine.admission import QueueFull  # noqa: E402
from ember.engine.intake import InvalidRequest  # noqa: E402
from ember.engine.output import RequestOutput  # noqa: E402
from ember.engine.thread import EngineStopped  # noqa: E402
from ember.models.loader import load_model_meta  # noqa: E402
from ember.sampling.params import SamplingParams  # noqa: E402

HANG = "hang"


class Stream:
    def __init__(self, items: list) -> None:
        self.items, self.cancelled = list(items), False

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item == HANG:
            await asyncio.sleep(3600)
        if isinstance(item, BaseException):
            raise item
        return wire.stream_item(item)  # as a replica sends it

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Dispatch i gets ``script[i]``; records each dispatch's avoided replicas."""

    def __init__(self, script: list[list]) -> None:
        self.script, self.avoided, self.streams = list(script), [], []
        self.specs: list[tuple] = []  # (prefill?, replica named, handoff) per dispatch
        self.sent: list = []  # the specs themselves

    def options(self, **_):
        return self

    def remote(self, message, blocks=None):
        """As Ray Serve would: the router places the request, then the replica answers."""
        from ember.cluster.router import view

        spec = wire.received_spec(message, blocks)
        self.avoided.append(tuple(spec.avoid))
        self.specs.append((spec.prefill, spec.replica, spec.handoff))
        self.sent.append(spec)
        items = self.script.pop(0)
        replica = items[0].replica if isinstance(items[0], Verdict) else f"dead{len(self.script)}"
        view().place(spec.request_id, replica)
        stream = Stream(items)
        self.streams.append(stream)
        return stream


def out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, text="x" * len(tokens), token_ids=tokens,
                         prompt_tokens=20, cached_tokens=16, finished=finished,
                         finish_reason="length" if finished else None,
                         delta_token_ids=tokens[-1:])


@pytest.fixture(scope="module")
def meta(tiny_gguf: Path):
    return load_model_meta(str(tiny_gguf), "f32")


@pytest.fixture
def make(meta):
    made = []

    def build(script: list[list], replicas: int = 2, handle: Handle | None = None,
              **config) -> tuple[ReplicaSet, Handle]:
        handle = handle or Handle(script)
        rs = ReplicaSet(handle, EngineConfig(model=str(meta.path), weights="f32", **config),
                        replicas, meta).start()
        rs.view.reset()
        made.append(rs)
        return rs, handle

    yield build
    for rs in made:
        deadline = time.monotonic() + 5
        while any(rs.view.inflight.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(rs.view.inflight.values()) and not rs.view.placed, rs.view.inflight
        rs.shutdown(timeout=5)


def prepare(rs: ReplicaSet, request_id: str = "g"):
    return rs.engine.prepare(list(range(100, 140)), SamplingParams(max_tokens=4),
                             request_id=request_id, tenant="t")


def collect(rs: ReplicaSet, group) -> list[RequestOutput]:
    """Submit through a slot and wait for the group's last output. (The fixture checks,
    after each test, that no stream is left counted on any replica.)"""
    got, done = [], threading.Event()

    def callback(o: RequestOutput) -> None:
        got.append(o)
        if o.finished:
            done.set()

    with rs.slot() as slot:
        slot.submit(group, callback)
    assert done.wait(10), got
    return got


def test_accepted_outputs_reach_the_callback_even_if_they_came_first(make) -> None:
    rs, _ = make([[Verdict("r1"), out("g", [5]), out("g", [5, 6], finished=True)]])
    group = prepare(rs)
    got = collect(rs, group)
    assert [o.token_ids for o in got] == [[5], [5, 6]] and got[-1].finish_reason == "length"


def test_a_replica_dying_before_its_verdict_is_replaced(make) -> None:
    rs, handle = make([[ActorDiedError()], [Verdict("r2"), out("g", [7], finished=True)]])
    got = collect(rs, prepare(rs))
    assert got[-1].token_ids == [7] and rs.view.retries == 1


def test_dispatch_gives_up_after_its_attempts(make) -> None:
    rs, handle = make([[ActorDiedError()] for _ in range(DISPATCH_ATTEMPTS)])
    with pytest.raises(EngineStopped):
        prepare(rs)
    assert not handle.script  # every scripted dispatch was tried, and no more


def test_a_full_replica_is_avoided_and_429_only_when_all_are_full(make) -> None:
    rs, handle = make([[Verdict("r1", "queue is full", "queue_full")],
                       [Verdict("r2"), out("g", [1], finished=True)]])
    collect(rs, prepare(rs))
    assert handle.avoided == [(), ("r1",)]
    rs, handle = make([[Verdict("r1", "queue is full", "queue_full")],
                       [Verdict("r2", "queue is full", "queue_full")]])
    with pytest.raises(QueueFull):
        prepare(rs)
    assert not rs.view.predicted_blocks


def test_an_invalid_request_is_the_replicas_error_as_is(make) -> None:
    rs, _ = make([[Verdict("r1", "max_tokens too big", "invalid", "max_tokens")]])
    with pytest.raises(InvalidRequest) as e:
        prepare(rs)
    assert (e.value.param, str(e.value)) == ("max_tokens", "max_tokens too big")


def test_a_number_the_wire_cannot_carry_is_refused_by_name(make) -> None:
    """The API bounds no seed: one past 64 bits is a 400 naming it, not a 500."""
    rs, handle = make([[Verdict("r1"), out("g", [1], finished=True)]])
    with pytest.raises(InvalidRequest) as e:
        rs.engine.prepare(list(range(100, 140)), SamplingParams(max_tokens=4, seed=2**70),
                          request_id="g", tenant="t")
    assert e.value.param == "seed" and not handle.sent


def test_death_before_any_token_fails_over_and_after_a_token_ends_with_an_error(make) -> None:
    rs, handle = make([[Verdict("r1"), ActorDiedError()],
                       [Verdict("r2"), out("g", [3]), out("g", [3, 4], finished=True)]])
    got = collect(rs, prepare(rs))
    assert got[-1].token_ids == [3, 4] and handle.avoided[1] == ("r1",)
    rs, handle = make([[Verdict("r1"), out("g", [3]), ActorDiedError()]])
    got = collect(rs, prepare(rs))
    assert got[-1].finish_reason == "error" and got[-1].token_ids == [3]
    assert got[-1].error == "the replica serving this request died"  # no Ray internals
    assert not handle.script  # not re-dispatched: the client already had a token


def test_a_request_that_kills_every_replica_is_not_retried_for_ever(make) -> None:
    script = [[Verdict(f"r{i}"), ActorDiedError()] for i in range(DISPATCH_ATTEMPTS)]
    rs, handle = make(script, replicas=8)
    got = collect(rs, prepare(rs))
    assert got[-1].finish_reason == "error" and not handle.script


def submit_then_abort(rs: ReplicaSet) -> list[RequestOutput]:
    """Submit a group whose replica hangs, abort it, and return what the client got
    (its last output must be an abort)."""
    group = prepare(rs)
    got, done = [], threading.Event()
    with rs.slot() as slot:
        slot.submit(group, lambda o: (got.append(o), o.finished and done.set()))
    rs.abort("g")
    assert done.wait(5) and got[-1].finish_reason == "abort"
    return got


def test_abort_cancels_the_live_stream(make) -> None:
    rs, handle = make([[Verdict("r1"), HANG]])
    submit_then_abort(rs)
    assert handle.streams[0].cancelled


def test_no_answer_in_time_is_a_503(make, monkeypatch) -> None:
    monkeypatch.setattr(front_mod, "DISPATCH_TIMEOUT_S", 0.2)
    rs, handle = make([[HANG]])
    with pytest.raises(EngineStopped):
        prepare(rs)
    assert handle.streams[0].cancelled


def test_a_tenants_queue_limit_counts_what_waits_on_every_replica(make) -> None:
    """max_queued=1 for tenant "t": while its first request waits on a replica (no token
    yet), its second is refused naming its own limit; another tenant still gets in; once
    the first is gone, "t" may queue again."""
    from ember.config import TenantLimits
    from ember.engine.admission import TenantQueueFull

    rs, _ = make([[Verdict("r1"), HANG]], tenant_limits={"t": TenantLimits(max_queued=1)})
    with rs.slot("t") as slot:  # as the server does: a place first, then prepare, submit
        slot.submit(prepare(rs), lambda o: None)
    deadline = time.monotonic() + 5
    while not (rs._groups and rs._groups["g"].callback) and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(TenantQueueFull, match=r"tenant 't' has 1 requests queued.*max_queued=1"):
        rs.slot("t")
    rs.slot("u").release()
    rs.abort("g")
    while rs._groups and time.monotonic() < deadline:
        time.sleep(0.01)
    rs.slot("t").release()


class PurgingHandle(Handle):
    """Answers purge_cache calls as each named replica would; records which it reached."""

    def __init__(self, removed: dict[str, int]) -> None:
        super().__init__([])
        self.removed, self.reached, self.purging = removed, [], False

    def options(self, method_name: str = "generate", **_):
        if method_name != "purge_cache":
            return self
        purger = PurgingHandle(self.removed)
        purger.reached, purger.purging = self.reached, True
        return purger

    def remote(self, message, blocks=None):
        if not self.purging:
            return super().remote(message, blocks)
        spec = wire.unpack(message, PurgeSpec)
        self.reached.append(spec.replica)
        n = self.removed[spec.replica]

        class Response:
            def result(self, timeout_s=None):
                return {"replica": spec.replica, "ram_blocks": n, "disk_blocks": 2 * n,
                        "disk_bytes": 100 * n}
        return Response()


def test_a_purge_reaches_every_replica_and_sums_what_went(make) -> None:
    handle = PurgingHandle({"r1": 3, "r2": 5})
    rs, _ = make([], handle=handle)
    for r in ("r1", "r2"):
        rs.view.observe(r, {"keys": [], "metrics": {}})
    assert rs.purge_cache("t") == {"ram_blocks": 8, "disk_blocks": 16, "disk_bytes": 800,
                                   "replicas": 2}
    assert sorted(handle.reached) == ["r1", "r2"]


def test_a_purge_refuses_to_report_success_it_cannot_vouch_for(make) -> None:
    """Fewer replicas known than deployed, or an answer from another replica than the
    one the purge was pinned to: a 503 to send it again, never a partial success."""
    handle = PurgingHandle({"r1": 3, "r2": 5})
    rs, _ = make([], handle=handle)
    rs.view.observe("r1", {"keys": [], "metrics": {}})
    with pytest.raises(EngineStopped, match="1 of 2 replicas"):
        rs.purge_cache("t")
    rs.view.observe("r2", {"keys": [], "metrics": {}})
    handle.removed["r2"] = 5
    original = PurgingHandle.remote

    def misrouted(self, message):
        spec = wire.unpack(message, PurgeSpec)
        if self.purging and spec.replica == "r2":
            message = wire.pack(PurgeSpec(spec.tenant, "r1"))
        return original(self, message)

    PurgingHandle.remote = misrouted
    try:
        with pytest.raises(EngineStopped, match="meant for replica r2 reached r1"):
            rs.purge_cache("t")
    finally:
        PurgingHandle.remote = original


def test_a_purge_is_pinned_to_its_replica_by_either_router() -> None:
    from ember.cluster.protocol import GroupSpec
    from ember.cluster.router import _pinned

    class Pending:
        def __init__(self, message: bytes) -> None:
            self.args = (message, None)

    by_id = {"r1": "replica-1", "r2": "replica-2"}
    assert _pinned(Pending(wire.pack(PurgeSpec("t", "r2"))), by_id) == [["replica-2"]]
    assert _pinned(Pending(wire.pack(PurgeSpec("t", "gone"))), by_id) == []
    group = GroupSpec("g", [1], [SamplingParams()], "t")
    assert _pinned(Pending(wire.pack(group)), by_id) is None


# ---------------------------------------------------------------- disaggregation
def _disaggregating(rs: ReplicaSet) -> None:
    """Two replicas the router knows, and a planner that hands every prompt over."""
    rs.planner = Planner(policy="always")
    for name in ("p", "d"):
        rs.view.observe(name, {"load": {"decoding": 0, "kv_bytes_per_block": 1000}})


def _handoff() -> Handoff:
    return Handoff([b"blocks"], 32, 6000, "r1", engine_seconds=0.05, export_seconds=0.01)


def test_a_disaggregated_group_prefills_on_one_replica_and_decodes_on_another(make) -> None:
    imported = {"offered": 32, "tokens": 32, "loaded": 12, "bytes": 6000, "seconds": 0.02,
                "error": ""}
    rs, handle = make([[Verdict("r1"), _handoff()],
                       [Verdict("r2", imported=imported), out("g", [4, 5], finished=True)]])
    _disaggregating(rs)
    got = collect(rs, prepare(rs))
    assert got[-1].token_ids == [4, 5]
    # of the decoder's 16 cached prompt tokens, the 12 the handoff loaded were computed
    # for this request: its usage does not count them as a cache hit
    assert got[-1].cached_tokens == 4
    (prefill, p, none), (decode, d, handoff) = handle.specs
    assert prefill and not decode and none is None and {p, d} == {"p", "d"}
    assert handoff is not None and handoff.tokens == 32  # the decoder got the KV
    m = rs.planner.metrics()
    assert m["decisions"] == {"disaggregated": 1} and m["handoffs"] == 1 and not m["failures"]
    assert m["observed"]["transfer"] == pytest.approx(0.03)  # export + import


def test_only_the_blocks_the_decoder_lacks_are_handed_over(make) -> None:
    rs, handle = make([[Verdict("r1"), _handoff()],
                       [Verdict("r2"), out("g", [4, 5], finished=True)]])
    _disaggregating(rs)
    keys = rs.engine.prefix_keys(list(range(100, 140)), "t")  # the group's 2 full blocks
    # the decoder holds the first block already (its digest says so)
    rs.view.observe("d", {"keys": keys[:1], "load": {"decoding": 0, "kv_bytes_per_block": 1000}})
    got = collect(rs, prepare(rs))
    assert got[-1].token_ids == [4, 5]
    prefill, decode = handle.sent
    assert prefill.prefill and prefill.replica == "p" and decode.replica == "d"
    assert prefill.handoff_from == 1  # the prefill replica exports block 1 on
    assert rs.planner.metrics()["last"]["transfer"] == pytest.approx(1000 / 1e9)  # 1 block


def test_a_prefill_replica_dying_leaves_the_decoder_to_recompute(make) -> None:
    rs, handle = make([[Verdict("r1"), ActorDiedError()],
                       [Verdict("r2"), out("g", [4, 5], finished=True)]])
    _disaggregating(rs)
    got = collect(rs, prepare(rs))
    assert got[-1].token_ids == [4, 5] and got[-1].finish_reason == "length"
    assert got[-1].cached_tokens == 16  # nothing handed over: its own cache's hits
    assert handle.specs[1][2] is None  # no KV: the decoder computes the prompt itself
    assert rs.planner.failures == 1 and rs.view.replica_failures == 1


def test_a_client_leaving_during_the_prefill_cancels_it_and_nothing_decodes(make) -> None:
    rs, handle = make([[Verdict("r1"), HANG]])
    _disaggregating(rs)
    submit_then_abort(rs)
    assert handle.streams[0].cancelled and len(handle.specs) == 1
