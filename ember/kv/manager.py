"""KVCacheManager: the one owner of block accounting for all requests.

It hands out block tables, admits waiting requests (attaching their cached prefix),
reserves blocks for scheduled tokens (evicting cached prefix blocks only under
pressure), forks a finished prompt into sibling requests, registers newly filled
blocks in the prefix cache, and frees a request's blocks when it leaves. After any
mix of finished, aborted, preempted, forked and failed requests, every block is
either free or held only by the prefix cache (``check_no_leaks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ember.kv.blocks import BlockAllocator, BlockTable, blocks_for
from ember.kv.prefix import ROOT, CachedBlock, PrefixCache, extend_keys, root_key
from ember.kv.snapshots import StateSnapshots
from ember.kv.tier import DiskTier, StateSource


class KVSequence(Protocol):
    """What the KV layer sees of a request: its history, its blocks and its cache scope
    (the engine's :class:`~ember.engine.request.Request` is one)."""

    request_id: str
    token_ids: list[int]
    salt: bytes  # prefix-cache scope: model and tenant
    block_table: BlockTable
    block_hashes: list[bytes]  # chain keys of the history's full blocks, as far as hashed
    cached_tokens: int  # prompt tokens taken from the cache at admission
    state_slot: int | None  # its recurrent-state slot while it holds KV (hybrid models)
    state_restore: bytes | None  # the snapshot its slot takes before its first step

    @property
    def num_prompt(self) -> int: ...

    @property
    def kv_len(self) -> int: ...

    @property
    def num_output(self) -> int: ...

    @property
    def wants_prompt_logprobs(self) -> bool: ...


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        state_slots: int = 0, state_snapshots: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.prefix = PrefixCache(self.allocator, block_size) if enable_prefix_caching else None
        # per request: identity serials of its leading full blocks registered so far;
        # a trailing None means the cache refused one, so later blocks are not offered
        self._chains: dict[str, list[int | None]] = {}
        self.tier: DiskTier | None = None
        self._restored: dict[str, int] = {}  # request id -> bytes restored for it from disk
        # this step's lookups, per waiting request: (cache version, history length), its
        # tokens and RAM hits
        self._lookups: dict[str, tuple[tuple[int, int], list[int], list[CachedBlock]]] = {}
        # a hybrid model's recurrent states: one slot per request holding KV (as many as
        # may run at once), taken at admission and given back with its blocks
        self._free_slots = list(range(state_slots - 1, -1, -1))
        self.state_slots = state_slots
        # their states at block boundaries, without which no cached prefix can be used
        self.snapshots = (StateSnapshots(state_snapshots)
                          if state_slots and state_snapshots and self.prefix else None)
        # this step's snapshots being written, per request: (its request, the boundary,
        # the slot, whether it is past the prompt); and each request's newest one past it
        # (its key and slot)
        self._pending: dict[str, tuple[KVSequence, int, int, bool]] = {}
        self._latest: dict[str, tuple[bytes, int]] = {}
        # per request, the snapshots it filed: (block index, chain key, serial); those
        # still filed when it is freed go to the disk tier, as its blocks do
        self._filed_by: dict[str, list[tuple[int, bytes, int]]] = {}

    # ------------------------------------------------------------ capacity
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_available(self) -> int:
        """Free blocks plus cached blocks that could be evicted."""
        return self.allocator.num_free + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def num_used(self) -> int:
        """Blocks held by requests (not counting those held only by the prefix cache)."""
        return self.num_blocks - self.num_available

    def new_table(self) -> BlockTable:
        return BlockTable(self.allocator, self.block_size)

    def blocks_for(self, n_tokens: int) -> int:
        return blocks_for(n_tokens, self.block_size)

    def can_reserve(self, req: KVSequence, n_tokens: int) -> bool:
        return req.block_table.blocks_needed(n_tokens) <= self.num_available

    def reserve(self, req: KVSequence, n_tokens: int) -> None:
        self._make_free(req.block_table.blocks_needed(n_tokens))
        req.block_table.reserve(n_tokens)

    def _make_free(self, n_blocks: int) -> None:
        need = n_blocks - self.allocator.num_free
        if need > 0 and self.prefix:
            self.prefix.evict(need)

    # ------------------------------------------------------------ admission
    def begin_step(self) -> None:
        """Forget the lookups of the last step (see :meth:`_lookup`)."""
        self._lookups.clear()

    def _lookup(self, req: KVSequence) -> tuple[list[int], list[CachedBlock]]:
        """The tokens a waiting request may take from the cache, and its RAM hits. Kept
        for the rest of the step unless the cache's contents change: the scheduler asks
        about each waiting request several times a step (predictions, prefetch,
        admission)."""
        if not self.prefix or req.kv_len or req.wants_prompt_logprobs:
            return [], []
        version = (self.prefix.version, self.snapshots.version if self.snapshots else 0,
                   len(req.token_ids))
        kept = self._lookups.get(req.request_id)
        if kept is not None and kept[0] == version:
            return kept[1], kept[2]
        extend_keys(req.block_hashes, req.salt, req.token_ids, self.block_size)
        # the last token is always recomputed for its logits
        tokens = req.token_ids[:-1]
        found = self.prefix.lookup(req.salt, tokens, req.block_hashes)
        self._lookups[req.request_id] = (version, tokens, found)
        return tokens, found

    def usable(self, keys: list[bytes], found: list[CachedBlock], salt: bytes = b"",
               tokens: Sequence[int] = (), source: StateSource | None = None
               ) -> list[CachedBlock]:
        """What of a cached prefix (``found`` for chain ``keys``) a request can use: all
        of it, but for a hybrid model only as far as the last block whose recurrent
        state has a snapshot (without one the blocks are of no use). A snapshot RAM
        lacks is taken from ``source`` (the disk tier, or records handed over with the
        prefix) into a slot, verified against ``salt`` and ``tokens``."""
        if not self.state_slots:
            return found
        if self.snapshots is None:
            return []
        for n in range(len(found), 0, -1):
            key, serial = keys[n - 1], found[n - 1].serial
            if self.snapshots.find(key, serial) is not None or (
                    source is not None and self._adopt(source, key, serial, n, salt, tokens)):
                return found[:n]
        return []

    def _adopt(self, source: StateSource, key: bytes, serial: int, n: int, salt: bytes,
               tokens: Sequence[int]) -> bool:
        """File ``source``'s snapshot after block ``n - 1`` (chain ``key``, cached as
        ``serial``) in a RAM slot; False if it has none that verifies (or no slot is free)."""
        assert self.snapshots is not None
        if not source.has_state(key):
            return False
        slot = self.snapshots.take()
        if slot is None:
            return False
        bs = self.block_size
        if not source.load_state(key, salt, tokens[(n - 1) * bs:n * bs], slot):
            self.snapshots.release(slot)
            return False
        self.snapshots.file(key, serial, slot, salt)
        return True

    def probe_prefix(self, req: KVSequence) -> list[CachedBlock]:
        """Cached blocks covering a prefix of a waiting request's history (no references
        taken, nothing counted), restored from the disk tier where it has more: the
        scheduler decides with it whether to admit. A hybrid model's prefix ends at
        the last block with a state snapshot, in RAM or on disk."""
        tokens, found = self._lookup(req)
        if self.tier is not None and self.prefix and tokens:
            ram = len(found)
            found = self.tier.extend(self.prefix, req.salt, tokens, req.block_hashes,
                                     list(found))
            if len(found) > ram:  # once: the next lookup finds them in RAM
                self._restored[req.request_id] = (
                    self._restored.get(req.request_id, 0)
                    + (len(found) - ram) * self.tier.storage.bytes_per_block)
        return self.usable(req.block_hashes, found, req.salt, tokens, self.tier)

    def take_restored(self, request_id: str) -> int:
        """Bytes the disk tier restored for a request's prefix (counted once)."""
        return self._restored.pop(request_id, 0)

    def loading(self, req: KVSequence) -> bool:
        """Whether a waiting request's prefix is being read from the disk tier (it is
        admitted when the read is done; until then it holds nothing and waits)."""
        if self.tier is None:
            return False
        tokens, found = self._lookup(req)
        return bool(tokens) and self.tier.prefetch(req.salt, tokens, req.block_hashes,
                                                   len(found), self.block_size)

    def uncached_at_least(self, req: KVSequence) -> int:
        """From any thread, for a request not yet queued: a lower bound on the prompt
        tokens it must compute. Its RAM prefix hits, read without the engine (a change
        made meanwhile can only make the answer stale, never raise); with a disk tier or
        recurrent state (whose hits this does not see) only its last, partial block,
        which no cache holds."""
        n = len(req.token_ids)
        floor = n % self.block_size or 1
        if not self.prefix or self.tier is not None or self.state_slots \
                or req.wants_prompt_logprobs:
            return floor
        keys: list[bytes] = []
        extend_keys(keys, req.salt, req.token_ids, self.block_size)
        try:
            found = self.prefix.lookup(req.salt, req.token_ids[:-1], keys)
        except (KeyError, RuntimeError):  # an entry went while it was read
            return floor
        return max(floor, n - len(found) * self.block_size)

    def cached_estimate(self, req: KVSequence) -> int:
        """Prompt tokens a waiting request would take from RAM or disk (nothing read)."""
        tokens, found = self._lookup(req)
        n = len(found)
        if self.tier is not None and tokens:
            n += self.tier.blocks_on_disk(req.block_hashes, n,
                                          min(len(req.block_hashes),
                                              len(tokens) // self.block_size))
        if self.state_slots:  # a hybrid's: as far as a snapshot reaches (none is read)
            while n and not self._snapshot_known(req.block_hashes, found, n):
                n -= 1
        return n * self.block_size

    def _snapshot_known(self, keys: list[bytes], found: list[CachedBlock], n: int) -> bool:
        """Whether the state after block ``n - 1`` has a snapshot in RAM (for a block
        found there) or on the disk tier (nothing is read)."""
        if self.snapshots is None:
            return False
        if n <= len(found) and self.snapshots.find(keys[n - 1], found[n - 1].serial) is not None:
            return True
        return self.tier is not None and self.tier.has_state(keys[n - 1])

    def attach_tier(self, tier: DiskTier) -> None:
        """Back the prefix cache with a disk tier (spill on release, restore on lookup)."""
        if self.prefix is None:
            raise ValueError("a KV disk tier needs the prefix cache")
        self.tier = tier
        self.prefix.spill = tier

    def can_admit(self, found: list[CachedBlock], n_tokens: int) -> bool:
        """Whether a request holding no blocks fits with ``found`` attached and room for
        ``n_tokens`` positions. Found blocks that sit in the LRU stop being evictable."""
        pinned = sum(1 for f in found if self.prefix and self.prefix.is_evictable(f.block))
        return self.blocks_for(n_tokens) - len(found) <= self.num_available - pinned

    def admit(self, req: KVSequence, found: list[CachedBlock], n_tokens: int) -> None:
        """Attach ``found`` (from :meth:`probe_prefix`) and reserve ``n_tokens`` positions."""
        if req.block_table.blocks:
            raise AssertionError(f"waiting request {req.request_id} holds KV blocks")
        if self.prefix:
            self.prefix.acquire(found, len(req.token_ids) - 1)
        for hit in found:
            req.block_table.append_block(hit.block)
        req.block_table.kv_len = len(found) * self.block_size
        self._chains[req.request_id] = [hit.serial for hit in found]
        if req.num_output == 0:
            req.cached_tokens = req.block_table.kv_len
        if self.state_slots:
            if not self._free_slots:
                raise AssertionError(f"no recurrent-state slot left for {req.request_id} "
                                     f"({self.state_slots} in all)")
            req.state_slot = self._free_slots.pop()
            if found:  # its state starts as the snapshot after the last found block
                assert self.snapshots is not None
                req.state_restore = req.block_hashes[len(found) - 1]
                self.snapshots.pin(req.state_restore)
        self.reserve(req, n_tokens)

    def fork(self, parent: KVSequence, child: KVSequence) -> tuple[int, int] | None:
        """Give ``child`` the parent's computed positions (its prompt): full blocks are
        shared, a partly filled last block is copied. Returns ``(src, dst)`` of the block
        whose contents the caller must copy, None if nothing to copy. Raises
        :class:`~ember.kv.blocks.OutOfBlocks` (child unchanged) when no block is left."""
        kv_len, table = parent.kv_len, parent.block_table
        full, partial = divmod(kv_len, self.block_size)
        copy = None
        if partial:
            self._make_free(1)
            copy = (table.blocks[full], self.allocator.allocate())
        for block in table.blocks[:full]:
            self.allocator.incref(block)
            child.block_table.append_block(block)
        if copy:
            child.block_table.append_block(copy[1])
        child.block_table.kv_len = kv_len
        child.cached_tokens = parent.cached_tokens
        child.block_hashes = list(parent.block_hashes)
        self._chains[child.request_id] = list(self._chains.get(parent.request_id, [])[:full])
        return copy

    # ------------------------------------------------------------ recurrent-state snapshots
    def take_restore(self, req: KVSequence) -> int | None:
        """The snapshot slot a request's state slot must take now, before its first step
        (None: none); it is no longer held for the request."""
        key, req.state_restore = req.state_restore, None
        if key is None:
            return None
        assert self.snapshots is not None
        return self.snapshots.unpin(key)

    def snapshot_point(self, req: KVSequence, start: int, n_tokens: int
                       ) -> tuple[int, int] | None:
        """Whether a row computing positions ``start .. start + n_tokens - 1`` should copy
        its recurrent state after one of them: ``(index in the row, snapshot slot)``, or
        None. Taken at the last block boundary of the prompt's history that lookups can
        reach, and at each later boundary (a request keeps its newest one of those)."""
        if self.snapshots is None or req.request_id in self._pending:
            return None
        bs = self.block_size
        prompt_boundary = (req.num_prompt - 1) // bs * bs
        if prompt_boundary and start < prompt_boundary <= start + n_tokens:
            boundary = prompt_boundary
        else:
            boundary = (start + n_tokens) // bs * bs
            if boundary <= max(start, prompt_boundary):
                return None
        slot = self.snapshots.take()
        if slot is None:
            return None
        self._pending[req.request_id] = (req, boundary, slot, boundary > prompt_boundary)
        return boundary - 1 - start, slot

    def file_snapshots(self, ok: bool = True) -> None:
        """After a step: file each snapshot it wrote under its block, once that block is
        in the prefix cache (else, or when the step failed, give its slot back)."""
        snapshots = self.snapshots
        if snapshots is None:
            return
        for rid, (req, boundary, slot, later) in self._pending.items():
            i = boundary // self.block_size - 1
            chain = self._chains.get(rid, [])
            if not ok or len(chain) <= i or chain[i] is None or len(req.block_hashes) <= i:
                snapshots.release(slot)
                continue
            key = req.block_hashes[i]
            if not snapshots.file(key, chain[i], slot, req.salt):
                continue
            if self.tier is not None:
                self._filed_by.setdefault(rid, []).append((i, key, chain[i]))
            if later:  # the request's previous one past its prompt goes, if still its own
                previous = self._latest.get(rid)
                if previous is not None and previous[0] != key:
                    snapshots.drop(*previous)
                self._latest[rid] = (key, slot)
        self._pending.clear()

    # ------------------------------------------------------------ prefix registration
    def register_computed(self, req: KVSequence) -> None:
        """Insert the request's newly completed full blocks into the prefix cache."""
        if not self.prefix:
            return
        chain = self._chains.setdefault(req.request_id, [])
        bs = self.block_size
        full = req.kv_len // bs
        if len(chain) >= full or (chain and chain[-1] is None):
            return
        extend_keys(req.block_hashes, req.salt, req.token_ids, bs)
        for i in range(len(chain), full):
            serial = self.prefix.insert(req.block_table.blocks[i], req.block_hashes[i],
                                        chain[-1] if chain else ROOT, req.salt,
                                        req.token_ids[i * bs:(i + 1) * bs],
                                        req.block_hashes[i - 1] if i else root_key(req.salt))
            chain.append(serial)
            if serial is None:
                break

    # ------------------------------------------------------------ release
    def free(self, req: KVSequence) -> None:
        """Release every block the request holds; cached ones stay findable."""
        blocks = list(req.block_table.blocks)
        req.block_table.release()
        self._chains.pop(req.request_id, None)
        self._restored.pop(req.request_id, None)
        if req.state_slot is not None:
            self._free_slots.append(req.state_slot)
            req.state_slot = None
        if self.snapshots is not None:
            self.take_restore(req)
            self._spill_snapshots(req)
            self._latest.pop(req.request_id, None)
            pending = self._pending.pop(req.request_id, None)
            if pending is not None:
                self.snapshots.release(pending[2])
        if self.prefix:
            for block in blocks:
                self.prefix.on_released(block)

    def _spill_snapshots(self, req: KVSequence) -> None:
        """Hand the disk tier the snapshots a request filed that are still in RAM."""
        filed = self._filed_by.pop(req.request_id, [])
        if self.tier is None or self.snapshots is None:
            return
        bs = self.block_size
        for i, key, serial in filed:
            slot = self.snapshots.find(key, serial)
            if slot is not None:
                self.tier.spill_snapshot(key, req.salt, req.token_ids[i * bs:(i + 1) * bs],
                                         slot)

    def truncate(self, req: KVSequence, keep_len: int) -> None:
        """Rewind a request's cache; forget registrations past the kept full blocks."""
        if keep_len >= req.kv_len:
            return
        chain = self._chains.get(req.request_id)
        if chain:
            del chain[keep_len // self.block_size:]
        self._released(req.block_table.truncate(keep_len))

    def trim(self, req: KVSequence) -> None:
        """Give back blocks reserved past the request's cached positions (those of draft
        tokens the step rejected)."""
        self._released(req.block_table.release_past(req.kv_len))

    def _released(self, blocks: list[int]) -> None:
        if self.prefix:
            for block in blocks:
                self.prefix.on_released(block)

    def check_no_leaks(self) -> None:
        """Every block is free or held only by the prefix cache (no requests alive)."""
        if len(self._free_slots) != self.state_slots:
            raise AssertionError(f"{self.state_slots - len(self._free_slots)} recurrent-state "
                                 "slots leaked")
        if self._pending or self._latest:
            raise AssertionError(f"{len(self._pending)} state snapshots pending, "
                                 f"{len(self._latest)} still tied to requests")
        if self.snapshots is not None:
            self.snapshots.check()
        for block, rc in enumerate(self.allocator.refcount):
            cached = bool(self.prefix and self.prefix.is_cached(block))
            if rc != (1 if cached else 0):
                raise AssertionError(f"KV block {block} leaked: refcount {rc}, cached={cached}")
