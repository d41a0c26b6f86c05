"""The prefix cache's disk tier: spill cached blocks to a DiskStore, restore chains.

Spill. A cached block is written to disk the first time it becomes evictable (its
last request released it), once: a block evicted later is already on disk, and a
process that dies keeps everything that was cached. Writing happens on the
store's thread; here the block's bytes are copied out in one operation.

Restore. A prefix lookup that stops in RAM at block ``i`` continues on disk: the run
of blocks ``i, i+1, ...`` whose keys the store holds is restored into free blocks
(evicting cached LRU blocks if needed, never the ones this lookup found) and
inserted into the RAM cache, so the request is admitted with them like any hit.
Each restored block must verify in the store (format, fingerprint, checksum) and
then carry the request's salt, its tokens and its parent's chain key; the first
that does not ends the restore (a miss, the rest is recomputed).

Restore or recompute, by measurement: a run is restored only if reading its bytes
(at the read bandwidth measured on earlier restores) is predicted to take less time
than recomputing its tokens (the step cost model's prediction for a prefill of
that length at that position), and each decision is counted.

Off the critical path: the scheduler first calls :meth:`DiskTier.prefetch` for a
waiting request. That decides once, and if restoring, reads and verifies the run's
files on a reader thread while the engine keeps stepping; the request is not
admitted meanwhile (it holds no pool blocks: the records wait in memory). When the
read is done, admission restores them with one copy per block. ``extend`` without a
prefetch reads synchronously (the Python API's single-threaded use, tests).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol

from ember.kv.blocks import BlockAllocator
from ember.kv.disk import BlockRecord, DiskStore
from ember.kv.prefix import ROOT, CachedBlock, PrefixCache, root_key

READ_BPS_PRIOR = 500e6  # bytes/s until a restore has been timed (a cold SSD read)
EWMA = 0.3  # weight of the newest restore's measured bandwidth
MAX_FETCHES = 64  # prefetches remembered (an aborted request's is dropped, oldest first)


class BlockBytes(Protocol):
    """What the tier needs of the KV storage: one block's bytes out and in."""

    def block_bytes(self, block: int) -> bytes: ...

    def load_block(self, block: int, data: bytes) -> None: ...

    @property
    def bytes_per_block(self) -> int: ...


class SnapshotBytes(Protocol):
    """A hybrid model's storage: one recurrent-state snapshot slot's bytes out and in."""

    def snapshot_bytes(self, slot: int) -> bytes: ...

    def load_snapshot(self, slot: int, data: bytes) -> None: ...

    @property
    def bytes_per_snapshot(self) -> int: ...


def state_key(block_key: bytes) -> bytes:
    """The store's key for the recurrent-state snapshot taken after a block."""
    return hashlib.blake2b(b"recurrent state\0" + block_key, digest_size=len(block_key)).digest()


def state_record(block_key: bytes, salt: bytes, tokens: Sequence[int],
                 payload: bytes) -> BlockRecord:
    """A snapshot as a record: keyed by :func:`state_key`, its parent the block it was
    taken after, with that block's salt and tokens (so it verifies as the block does)."""
    return BlockRecord(state_key(block_key), block_key, salt, tuple(tokens), payload)


def is_state(rec: BlockRecord) -> bool:
    """Whether a record is a recurrent-state snapshot rather than a KV block."""
    return rec.key == state_key(rec.parent)


def blocks_of(records: Sequence[BlockRecord]) -> list[BlockRecord]:
    """The KV blocks among ``records``, in order (a hybrid's exports also carry
    recurrent-state snapshots)."""
    return [rec for rec in records if not is_state(rec)]


def load_state_record(rec: BlockRecord, block_key: bytes, salt: bytes, tokens: Sequence[int],
                      storage: SnapshotBytes, slot: int,
                      discard: Callable[[bytes], None] | None = None) -> bool:
    """Load ``rec`` into snapshot ``slot`` if it is the state after block ``block_key``
    (salt, tokens and size checked); False, nothing loaded, if not."""
    if not _fits(rec, state_key(block_key), block_key, salt, tuple(tokens),
                 storage.bytes_per_snapshot, discard):
        return False
    storage.load_snapshot(slot, rec.payload)
    return True


class StateSource(Protocol):
    """Snapshots a hybrid's RAM slots lack, by the chain key of the block each follows:
    the disk tier's, or those handed over with an imported prefix."""

    def has_state(self, key: bytes) -> bool: ...

    def load_state(self, key: bytes, salt: bytes, tokens: Sequence[int], slot: int) -> bool: ...


class HandedStates:
    """The snapshot records that came with an imported prefix, as a :class:`StateSource`."""

    def __init__(self, records: Sequence[BlockRecord], storage: SnapshotBytes) -> None:
        self.by_block = {rec.parent: rec for rec in records if is_state(rec)}
        self.storage = storage

    def has_state(self, key: bytes) -> bool:
        return key in self.by_block

    def load_state(self, key: bytes, salt: bytes, tokens: Sequence[int], slot: int) -> bool:
        return load_state_record(self.by_block[key], key, salt, tokens, self.storage, slot)


class DiskTier:
    def __init__(self, store: DiskStore, storage: BlockBytes,
                 recompute_seconds: Callable[[int, int], float], policy: str = "auto") -> None:
        """``recompute_seconds(tokens, end)``: predicted time to prefill ``tokens``
        positions ending at position ``end``. ``policy`` ``always`` restores whatever
        the store has (to measure or test restores), ``auto`` only where faster."""
        self.store = store
        self.policy = policy
        self.storage = storage
        self.recompute_seconds = recompute_seconds
        self.read_bps = READ_BPS_PRIOR
        self.decisions = {"restore": 0, "recompute": 0}
        self.restored_blocks = 0
        self.restored_snapshots = 0
        # first key of a run -> its read in flight or done (None: recompute was decided)
        self._fetches: OrderedDict[bytes, Future[tuple[list[BlockRecord], float]] | None] = (
            OrderedDict())
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ember-kv-read")

    # ------------------------------------------------------------ spill
    def spill(self, block: int, key: bytes, parent_key: bytes, salt: bytes,
              tokens: tuple[int, ...]) -> None:
        if key not in self.store:
            self.store.put(BlockRecord(key, parent_key, salt, tokens,
                                       self.storage.block_bytes(block)))

    # ------------------------------------------------------------ snapshots (hybrids)
    def spill_snapshot(self, key: bytes, salt: bytes, tokens: Sequence[int],
                       slot: int) -> None:
        """Store the snapshot in ``slot``, taken after the block with chain key ``key``
        (and these ``tokens``), once; it verifies as that block's records do."""
        if state_key(key) not in self.store:
            storage: SnapshotBytes = self.storage  # type: ignore[assignment]
            self.store.put(state_record(key, salt, tokens, storage.snapshot_bytes(slot)))

    def has_state(self, key: bytes) -> bool:
        return state_key(key) in self.store

    def load_state(self, key: bytes, salt: bytes, tokens: Sequence[int], slot: int) -> bool:
        """Read the snapshot stored after block ``key`` into ``slot``; False if there is
        none or it does not verify (salt, block, tokens; a wrong size also deletes it)."""
        rec = self.store.get(state_key(key))
        if rec is None:
            return False
        storage: SnapshotBytes = self.storage  # type: ignore[assignment]
        if not load_state_record(rec, key, salt, tokens, storage, slot, self.store.discard):
            return False
        self.restored_snapshots += 1
        return True

    # ------------------------------------------------------------ restore
    def blocks_on_disk(self, keys: Sequence[bytes], start: int, stop: int) -> int:
        """How many blocks from ``start`` on the store holds (no read, nothing decided)."""
        n = 0
        while start + n < stop and keys[start + n] in self.store:
            n += 1
        return n

    def worth_restoring(self, n_blocks: int, block_size: int, start: int) -> bool:
        """Whether reading ``n_blocks`` is predicted faster than recomputing them."""
        read = n_blocks * self.storage.bytes_per_block / self.read_bps
        tokens = n_blocks * block_size
        recompute = self.recompute_seconds(tokens, (start + n_blocks) * block_size)
        restore = read < recompute or self.policy == "always"
        self.decisions["restore" if restore else "recompute"] += 1
        return restore

    def _read(self, keys: Sequence[bytes]) -> tuple[list[BlockRecord], float]:
        """The run's records, read and verified in order (until the first miss)."""
        began, out = time.perf_counter(), []
        for key in keys:
            rec = self.store.get(key)
            if rec is None:
                break
            out.append(rec)
        return out, time.perf_counter() - began

    def prefetch(self, salt: bytes, tokens: Sequence[int], keys: Sequence[bytes],
                 start: int, block_size: int) -> bool:
        """Start reading the disk run after block ``start`` (decided once per run);
        True while that read is in flight (do not admit the request yet)."""
        n = self.blocks_on_disk(keys, start, min(len(keys), len(tokens) // block_size))
        if n == 0:
            return False
        key = keys[start]
        if key not in self._fetches:
            restore = self.worth_restoring(n, block_size, start)
            self._fetches[key] = (self._reader.submit(self._read, keys[start:start + n])
                                  if restore else None)
            while len(self._fetches) > MAX_FETCHES:
                self._fetches.popitem(last=False)
        fetch = self._fetches[key]
        return fetch is not None and not fetch.done()

    def extend(self, cache: PrefixCache, salt: bytes, tokens: Sequence[int],
               keys: Sequence[bytes], found: list[CachedBlock]) -> list[CachedBlock]:
        """``found`` (the RAM hits for ``tokens``) extended with blocks restored from disk:
        those a :meth:`prefetch` read, else read now."""
        bs = cache.block_size
        start = len(found)
        if start >= min(len(keys), len(tokens) // bs):
            return found
        if keys[start] in self._fetches:
            fetch = self._fetches.pop(keys[start])
            if fetch is None:
                return found  # recomputing was decided
            records, seconds = fetch.result()
        else:
            n = self.blocks_on_disk(keys, start, min(len(keys), len(tokens) // bs))
            if n == 0 or not self.worth_restoring(n, bs, start):
                return found
            records, seconds = self._read(keys[start:start + n])
        nbytes = sum(len(r.payload) for r in records)
        if nbytes and seconds > 0:
            self.read_bps += EWMA * (nbytes / seconds - self.read_bps)
        restore_chain(cache, self.storage, salt, tokens, keys, found,
                      lambda i: records[i - start], start + len(records), self.store.discard)
        self.restored_blocks += len(found) - start
        return found

    def forget_reads(self) -> None:
        """Drop every prefetched or decided run (after a purge: nothing read before it
        may be restored)."""
        self._fetches.clear()

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a prefetch in flight completes or ``timeout`` s pass."""
        pending = [f for f in self._fetches.values() if f is not None and not f.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)



def restore_chain(cache: PrefixCache, storage: BlockBytes, salt: bytes, tokens: Sequence[int],
                  keys: Sequence[bytes], found: list[CachedBlock],
                  fetch: Callable[[int], BlockRecord | None], stop: int,
                  discard: Callable[[bytes], None] | None = None, stored: bool = True) -> int:
    """Append to ``found`` the blocks ``len(found) .. stop-1`` of ``tokens`` that
    ``fetch(i)`` supplies and that verify, loaded into free pool blocks and cached;
    stop at the first that does not. Returns the bytes loaded.

    A record verifies if it carries the request's salt, block ``i``'s chain key and
    tokens, and the previous block's chain key as its parent. Blocks are found room
    for by evicting cached LRU blocks, never those already in ``found``. ``stored``:
    the disk tier already has them (else it gets them when they become evictable).
    """
    bs = cache.block_size
    allocator: BlockAllocator = cache.allocator
    start = len(found)
    held = [f.block for f in found]
    cache.pin(held)  # restoring must not evict what this lookup already found
    restored: list[int] = []
    nbytes = 0
    try:
        parent_key = keys[start - 1] if start else root_key(salt)
        parent = found[-1].serial if found else ROOT
        for i in range(start, stop):
            rec = fetch(i)
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            if rec is None or not _fits(rec, keys[i], parent_key, salt, chunk,
                                        storage.bytes_per_block, discard):
                break  # a miss: recompute from here
            if allocator.num_free == 0 and cache.evict(1) == 0:
                break
            block = allocator.allocate()
            restored.append(block)
            storage.load_block(block, rec.payload)
            allocator.filled(block)
            nbytes += len(rec.payload)
            serial = cache.insert(block, keys[i], parent, salt, chunk, parent_key, stored)
            if serial is None:
                break
            found.append(CachedBlock(block, serial))
            parent_key, parent = keys[i], serial
    finally:
        cache.unpin(held + restored)  # restored blocks: the cache's reference remains
    return nbytes


def _fits(rec: BlockRecord, key: bytes, parent: bytes, salt: bytes, tokens: tuple[int, ...],
          size: int, discard: Callable[[bytes], None] | None) -> bool:
    """Whether a stored record is the one a lookup asked for: its key, parent, salt and
    tokens (else it is another chain's under this key: a miss), and its size (else it
    is not ours to keep: deleted, where ``discard`` is given)."""
    if rec.key != key or rec.parent != parent or rec.salt != salt or rec.tokens != tokens:
        return False
    if len(rec.payload) != size:
        if discard is not None:
            discard(key)
        return False
    return True
