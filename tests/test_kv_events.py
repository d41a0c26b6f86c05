"""KV-cache events (--kv-events-endpoint) read by a real subscriber: pyzmq and msgspec
decoding the frames with the types of vLLM's example subscriber
(examples/online_serving/kv_events_subscriber.py), replaying gaps as it does (from a
DEALER socket: the replay answers with a stream of frames, which a REQ socket, as the
example has, cannot read past the first)."""

from __future__ import annotations

import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from ember import LLM, SamplingParams  # noqa: E402
from ember.kv.events import external_hash  # noqa: E402
from ember.kv.prefix import tenant_name  # noqa: E402


# The subscriber's types, as vLLM's example declares them (six fields of BlockStored:
# the fields ember adds after them, lora_name and extra_keys, are read separately).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """A router's index: block hash -> tenant, built from the events (a gap in the
    sequence numbers is filled from the replay socket first)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.raw = msgspec.msgpack.Decoder()  # the fields after the example's six
        self.index: dict[int, str] = {}
        self.last_seq = -1
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.replayed = 0

    def drain_until(self, seq: int, seconds: float = 20) -> None:
        deadline = time.monotonic() + seconds
        while self.last_seq < seq:
            assert time.monotonic() < deadline, (self.last_seq, seq)
            if not self.sub.poll(100):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            got = int.from_bytes(seq_bytes, "big")
            if got > self.last_seq + 1:
                self._replay(got)
            if got > self.last_seq:
                self._apply(payload)
                self.last_seq = got

    def _replay(self, upto: int) -> None:
        self.replay.send_multipart((b"", (self.last_seq + 1).to_bytes(8, "big")))
        while True:
            _, seq_bytes, payload = self.replay.recv_multipart()
            if not payload:
                return  # the end marker
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq < seq < upto:
                self._apply(payload)
                self.last_seq = seq
                self.replayed += 1

    def _apply(self, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        raw_events = self.raw.decode(payload)[1]
        for event, raw in zip(batch.events, raw_events, strict=True):
            self.counts[type(event).__name__] += 1
            if isinstance(event, AllBlocksCleared):
                self.index.clear()
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.index.pop(h)  # a removal of a block never stored fails here
            else:
                assert event.medium == "CPU" and event.block_size == 16
                assert len(event.token_ids) == 16 * len(event.block_hashes)
                if event.parent_block_hash is not None:
                    assert event.parent_block_hash in self.index
                extra_keys = raw[8]
                for h, (tenant,) in zip(event.block_hashes, extra_keys, strict=True):
                    assert h not in self.index
                    self.index[h] = tenant


def _cached(llm: LLM) -> dict[int, str]:
    """What the engine's prefix cache holds: block hash -> tenant."""
    prefix = llm.engine.kv.prefix
    return {external_hash(key): tenant_name(salt)
            for key, _, salt, _ in (prefix.identity(b) for b in list(prefix._entries))}


def test_a_subscriber_rebuilds_each_tenants_blocks_from_the_events(smollm2_served_llm,
                                                                   smollm2_adapters):
    """A mixed workload of two tenants (one also through an adapter) in a pool small
    enough to evict, then a purge of one tenant: the index a late subscriber builds from
    the events (what it missed before connecting replayed) equals the blocks each
    tenant holds in ember's prefix cache, hash for hash."""
    llm = LLM(str(smollm2_served_llm.engine.config.model),
              loaded=smollm2_served_llm.engine.loaded, num_kv_blocks=40,
              kv_events_endpoint="tcp://127.0.0.1:*",
              kv_events_replay_endpoint="tcp://127.0.0.1:*",
              loras={"style": smollm2_adapters["gguf"]})
    publisher = llm.engine.events_publisher
    params = SamplingParams(max_tokens=4, temperature=0)
    topics = ["the sea", "a mountain", "the city at night", "an old library", "a garden"]
    llm.generate([f"Write a long story about {topics[0]}. " * 20], params, tenant="alice")
    subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    for i, topic in enumerate(topics):
        prompt = f"Write a long story about {topic}. " * 20
        llm.generate([prompt], params, tenant="alice")
        llm.generate([prompt], params, tenant="bob", lora="style" if i % 2 else None)
    subscriber.drain_until(publisher.queued - 1)
    assert subscriber.counts["BlockRemoved"] > 0  # the pool evicted
    assert subscriber.replayed > 0  # what was sent before it connected came by replay
    assert subscriber.index == _cached(llm)
    assert set(subscriber.index.values()) == {"alice", "bob"}

    removed = llm.engine.purge_cache("alice")["ram_blocks"]
    assert removed > 0
    subscriber.drain_until(publisher.queued - 1)
    assert subscriber.index == _cached(llm)
    assert set(subscriber.index.values()) == {"bob"}
    publisher.close()


def test_events_need_the_prefix_cache():
    from ember.config import EngineConfig, InvalidConfig

    with pytest.raises(InvalidConfig, match="kv_events_endpoint"):
        EngineConfig(kv_events_endpoint="tcp://127.0.0.1:*", enable_prefix_caching=False)
