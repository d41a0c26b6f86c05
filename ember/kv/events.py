"""KV-cache events in vLLM's wire format, for routers that route by prefix (llm-d,
NVIDIA Dynamo, KServe, the vLLM production stack).

What is published is what the prefix cache can serve: a block becomes findable
(``BlockStored``), stops being findable (``BlockRemoved``: evicted, purged, replaced),
or all of them go at once (``AllBlocksCleared``). The engine thread records events as
the cache changes (:class:`KVEvents`, called from :class:`ember.kv.prefix.PrefixCache`)
and hands each step's batch to a publisher thread that owns the sockets
(:class:`ZmqPublisher`), so the engine never waits on the network.

The wire, as vLLM's ``ZmqEventPublisher`` sends it and its example subscriber decodes
it: a PUB socket sends multipart ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
counter and ``payload`` a msgpack ``[ts, [event, ...]]``; each event an array whose
first item names its type (msgspec's ``array_like`` + ``tag`` encoding):

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys]``; ``extra_keys`` one ``[tenant]`` per block;
- ``["BlockRemoved", block_hashes, medium]``;
- ``["AllBlocksCleared"]``.

A replay socket (ROUTER) answers a request carrying a start seq (8 bytes big-endian)
with every buffered ``[seq, payload]`` from it, then ``[-1, b""]``.

The hashes are ember's own block keys, so no router needs to re-derive them: a block's
key is ``blake2b-128(parent key ‖ its token ids as u32 little-endian)``, the first
block's parent the root key of its salt (model fingerprint, tenant, adapter: see
:mod:`ember.kv.prefix`); the published hash is the key's first 8 bytes read as an
unsigned big-endian integer. The same tokens of two tenants are two blocks with two
hashes, exactly as ember caches them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ember.kv.prefix import tenant_name

log = logging.getLogger("ember.kv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_hash(key: bytes) -> int:
    """A block key as routers see it: its first 8 bytes, unsigned big-endian."""
    return int.from_bytes(key[:8], "big")


def adapter_identity(salt: bytes) -> bytes | None:
    """The LoRA adapter identity a prefix salt carries (None: the base model)."""
    _, sep, identity = salt.partition(b"\0lora:")
    return identity if sep else None


class KVEvents:
    """One engine's event log: filled on the engine thread as the prefix cache
    changes, handed to ``publish`` once per step (:meth:`flush`).

    ``lora_name(identity)`` names the adapter a salt carries (the engine's registry)."""

    def __init__(self, publish: Callable[[list[list[Any]]], None], block_size: int,
                 medium: str = "CPU",
                 lora_name: Callable[[bytes], str | None] = lambda identity: None) -> None:
        self._publish, self.block_size, self.medium = publish, block_size, medium
        self._lora_name = lora_name
        self._pending: list[list[Any]] = []
        # the hash and salt the last BlockStored ended with: a block continuing it joins it
        self._last: tuple[int, bytes] | None = None

    def stored(self, key: bytes, parent_key: bytes | None, tokens: Sequence[int],
               salt: bytes) -> None:
        """A block became findable; a run of blocks of one chain is one event."""
        h, tenant = external_hash(key), tenant_name(salt)
        parent = None if parent_key is None else external_hash(parent_key)
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "BlockStored" and self._last == (parent, salt):
            last[1].append(h)
            last[3].extend(tokens)
            last[8].append([tenant])
        else:
            identity = adapter_identity(salt)
            name = None if identity is None else self._lora_name(identity)
            self._pending.append(["BlockStored", [h], parent, list(tokens), self.block_size,
                                  None, self.medium, name, [[tenant]]])
        self._last = (h, salt)

    def removed(self, key: bytes) -> None:
        h, last = external_hash(key), self._pending[-1] if self._pending else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(h)
        else:
            self._pending.append(["BlockRemoved", [h], self.medium])
        self._last = None

    def cleared(self) -> None:
        """Every block went at once: what came before it in the batch no longer matters."""
        self._pending = [["AllBlocksCleared"]]
        self._last = None

    def flush(self) -> None:
        """Publish what the step recorded (nothing when it recorded nothing)."""
        if self._pending:
            events, self._pending, self._last = self._pending, [], None
            self._publish(events)


class ZmqPublisher:
    """The publisher thread: owns a PUB socket (bound to ``endpoint``) and, with
    ``replay_endpoint``, a ROUTER socket serving the last ``buffer`` batches. Batches
    queue without blocking the caller; past ``max_queued`` waiting, the newest is
    dropped and counted (a subscriber sees the gap in ``seq`` only if it was sent, so a
    dropped batch is a lost one: the metric says how many)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer: int = 10_000, max_queued: int = 100_000) -> None:
        import zmq  # only a server that publishes needs pyzmq loaded

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._queue: queue.Queue[list[list[Any]] | None] = queue.Queue(max_queued)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.queued = 0  # batches accepted: the last one will go out as seq queued - 1
        self.published = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="ember-kv-events",
                                        daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return self._replay.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def publish(self, events: list[list[Any]]) -> None:
        try:
            self._queue.put_nowait(events)
            self.queued += 1
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        import msgpack

        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = msgpack.packb([time.time(), events])
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [identity, b"", start seq]
            log.warning("kv events: a malformed replay request was ignored")
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
