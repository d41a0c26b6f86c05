"""Prefix cache: full KV blocks findable by the tokens they hold, scoped by a salt.

A block's key is a hash chain: ``key_i = H(key_{i-1}, tokens of block i)`` with
``key_{-1} = H(salt)``. The salt covers the tenant and the model fingerprint and is
supplied by whoever owns the request (the server derives it from the API key), so
two tenants never share keys and cannot observe each other's prefixes.

A hash hit is never trusted alone. Every cached block records its *identity*: a
serial number that is never reused, the serial of the block before it in its chain
(0 for a first block), the salt and its own token ids. A hit on block ``i`` is
served only if its salt and tokens equal the request's and its parent is exactly
the block served for ``i - 1``. By induction a served block was computed after the
very same salt and tokens, so a hash collision anywhere in a chain can only cost a
miss, never serve another prompt's or another tenant's cache.

The cache holds one reference on each cached block. Blocks whose only reference is
the cache's are *evictable*; they are reclaimed only when the pool runs out of free
blocks, fairly between tenants: from the tenant that holds the most cached blocks
(every adapter of a tenant counts as the tenant), least recently used first within
it. So a tenant flooding the cache with prefixes evicts its own before anyone else's,
and a tenant holding less than another keeps its prefixes however hard the other
floods. A tenant may also have a hard cap (``cap``): past it, its own least recently
used evictable blocks go at once, whether the pool is short or not. With a disk tier
(ember.kv.tier) a block is handed to it the first time it becomes evictable, so that
it outlives eviction and the process.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ember.kv.blocks import BlockAllocator

ROOT = 0  # the "parent serial" of a chain's first block


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def tenant_salt(model_salt: bytes, tenant: str | None, adapter: bytes | None = None) -> bytes:
    """A tenant's prefix-cache salt: the model's fingerprint + the tenant (+ the identity
    of the LoRA adapter the request runs with: no prefix is shared across adapters),
    never request content. The engine and the replica router (which must predict the
    engine's keys) both derive it here."""
    salt = model_salt + b"\0tenant:" + (tenant or "").encode()
    return salt if adapter is None else salt + b"\0lora:" + adapter


def tenant_scope(model_salt: bytes, tenant: str | None) -> Callable[[bytes], bool]:
    """Whether a salt is ``tenant``'s (with or without an adapter): what a purge of the
    tenant's cached prefixes removes. Exact, so tenant "a" never matches tenant "ab"."""
    base = tenant_salt(model_salt, tenant)
    return lambda salt: tenant_of(salt) == base


def tenant_of(salt: bytes) -> bytes:
    """The tenant part of a salt (its adapter's identity dropped): the scope cache
    fairness counts by."""
    return salt.split(b"\0lora:", 1)[0]


def tenant_name(salt: bytes) -> str:
    """The tenant a salt (or a tenant scope) was derived for."""
    return tenant_of(salt).rpartition(b"\0tenant:")[2].decode(errors="replace")


def root_key(salt: bytes) -> bytes:
    return hashlib.blake2b(b"ember-prefix-v1\0" + salt, digest_size=16).digest()


def extend_keys(keys: list[bytes], salt: bytes, tokens: Sequence[int], block_size: int) -> None:
    """Append the chain keys of the full blocks of ``tokens`` that ``keys`` lacks.

    Callers keep ``keys`` per request, so each block is hashed once however often the
    request is looked up (a waiting request is probed every step until admitted).
    """
    parent = keys[-1] if keys else root_key(salt)
    for i in range(len(keys), len(tokens) // block_size):
        parent = chain_key(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)


@dataclass(frozen=True)
class CachedBlock:
    """What a lookup found: the block id and its identity's serial."""

    block: int
    serial: int


@dataclass(frozen=True)
class _Entry:
    key: bytes
    serial: int
    parent: int  # serial of the previous block of the chain, ROOT for a first block
    salt: bytes  # the salt the chain was computed under
    tokens: tuple[int, ...]
    parent_key: bytes  # chain key of the previous block (the root key for a first block)


class Spill(Protocol):
    """Where a cached block goes when it first becomes evictable (the disk tier)."""

    def spill(self, block: int, key: bytes, parent_key: bytes, salt: bytes,
              tokens: tuple[int, ...]) -> None: ...


class KVEventSink(Protocol):
    """Who hears of blocks becoming findable and ceasing to be (ember.kv.events)."""

    def stored(self, key: bytes, parent_key: bytes | None, tokens: Sequence[int],
               salt: bytes) -> None: ...

    def removed(self, key: bytes) -> None: ...


class _FairLRU:
    """Evictable blocks, least recently used first, one order per tenant scope."""

    def __init__(self) -> None:
        self._by_scope: dict[bytes, OrderedDict[int, None]] = {}
        self._scope: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._scope)

    def __contains__(self, block: int) -> bool:
        return block in self._scope

    def add(self, block: int, scope: bytes) -> None:
        """``block`` became evictable (or was used again): the most recent of its scope."""
        self.pop(block)
        self._scope[block] = scope
        self._by_scope.setdefault(scope, OrderedDict())[block] = None

    def pop(self, block: int) -> None:
        scope = self._scope.pop(block, None)
        if scope is not None:
            lru = self._by_scope[scope]
            del lru[block]
            if not lru:
                del self._by_scope[scope]

    def oldest(self, scope: bytes) -> int | None:
        """The least recently used evictable block of ``scope`` (None: it has none)."""
        lru = self._by_scope.get(scope)
        return next(iter(lru)) if lru else None

    def victim(self, held: Counter[bytes]) -> int:
        """The least recently used block of the scope holding the most cached blocks
        (of those with an evictable one; ties: the first such scope)."""
        scope = max(self._by_scope, key=lambda s: held[s])
        return next(iter(self._by_scope[scope]))


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._by_key: dict[bytes, int] = {}
        self._entries: dict[int, _Entry] = {}  # block id -> identity
        self._evictable = _FairLRU()
        self._held: Counter[bytes] = Counter()  # cached blocks per tenant scope
        self.spill: Spill | None = None
        self.events: KVEventSink | None = None  # a router's view (ember.kv.events)
        # the most blocks a tenant scope may keep cached (None: no cap of its own)
        self.cap: Callable[[bytes], int | None] = lambda scope: None
        self._stored: set[int] = set()  # cached blocks the spill already has
        self._serials = itertools.count(ROOT + 1)
        self.queries = 0  # prompt tokens looked up (once per admitted request)
        self.hits = 0  # prompt tokens served from cache
        self.version = 0  # changes whenever what lookup() can find changes

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        """The chain keys of every cached block (safe to call from another thread: the
        copy is one C-level pass under the GIL)."""
        return list(self._by_key.copy())

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._entries

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, salt: bytes, tokens: Sequence[int],
               keys: Sequence[bytes] | None = None) -> list[CachedBlock]:
        """Longest run of cached full blocks that prefixes ``tokens`` (no references taken).

        ``keys`` are the chain keys of ``tokens``' full blocks (see :func:`extend_keys`),
        computed here when not given.
        """
        bs = self.block_size
        if keys is None:
            keys = []
            extend_keys(keys, salt, tokens, bs)  # type: ignore[arg-type]
        found: list[CachedBlock] = []
        parent = ROOT
        for i in range(min(len(keys), len(tokens) // bs)):
            block = self._by_key.get(keys[i])
            if block is None:
                break
            entry = self._entries[block]
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            if entry.parent != parent or entry.tokens != chunk or entry.salt != salt:
                break  # a hash collision: the block holds another chain's cache
            found.append(CachedBlock(block, entry.serial))
            parent = entry.serial
        return found

    def identity(self, block: int) -> tuple[bytes, bytes, bytes, tuple[int, ...]]:
        """A cached block's chain key, parent key, salt and tokens."""
        e = self._entries[block]
        return e.key, e.parent_key, e.salt, e.tokens

    def acquire(self, found: Sequence[CachedBlock], queried_tokens: int) -> None:
        """Take a reference on each found block for a request; count the query once."""
        for hit in found:
            self._evictable.pop(hit.block)
            self.allocator.incref(hit.block)
        self.queries += queried_tokens
        self.hits += len(found) * self.block_size

    def insert(self, block: int, key: bytes, parent: int, salt: bytes,
               tokens: Sequence[int], parent_key: bytes, stored: bool = False) -> int | None:
        """Make a full, computed block findable; return the serial of its identity.

        ``parent`` is the serial returned for the previous block of the same sequence
        (ROOT for its first block) and ``parent_key`` that block's chain key (the root
        key for a first block). If an identical block is already cached, its serial
        is returned and ``block`` stays private. ``None`` means the block cannot be
        cached (it already is, under another identity). ``stored``: the spill already
        has this block (it was restored from there).
        """
        tokens = tuple(tokens)
        existing = self._by_key.get(key)
        if existing is not None:
            e = self._entries[existing]
            if e.parent == parent and e.tokens == tokens and e.salt == salt:
                return e.serial
            # Same key, other identity: usually an orphan whose parent was evicted and
            # recomputed under a new serial, in theory a hash collision. Newest wins.
            self._uncache(existing)
        if block in self._entries:  # one block, two identities: refuse rather than alias
            return None
        serial = next(self._serials)
        self._by_key[key] = block
        self.version += 1
        self._entries[block] = _Entry(key, serial, parent, salt, tokens, parent_key)
        self._held[tenant_of(salt)] += 1
        if self.events is not None:
            self.events.stored(key, None if parent == ROOT else parent_key, tokens, salt)
        if stored:
            self._stored.add(block)
        self.allocator.incref(block)
        return serial

    def on_released(self, block: int) -> None:
        """A user dropped its reference; if only the cache holds it now, it is evictable
        (and, the first time, handed to the spill: its contents are final)."""
        entry = self._entries.get(block)
        if entry is None or self.allocator.refcount[block] != 1:
            return
        scope = tenant_of(entry.salt)
        self._evictable.add(block, scope)
        if self.spill is not None and block not in self._stored:
            self._stored.add(block)
            self.spill.spill(block, entry.key, entry.parent_key, entry.salt, entry.tokens)
        cap = self.cap(scope)
        while cap is not None and self._held[scope] > cap:
            oldest = self._evictable.oldest(scope)
            if oldest is None:
                break  # the rest is in use: it goes when released
            self._uncache(oldest)

    def pin(self, blocks: Sequence[int]) -> None:
        """Hold a reference on cached ``blocks`` so that no eviction can take them."""
        for block in blocks:
            self._evictable.pop(block)
            self.allocator.incref(block)

    def unpin(self, blocks: Sequence[int]) -> None:
        """Drop references taken by :meth:`pin` or by allocating a block since cached."""
        for block in blocks:
            self.allocator.decref(block)
            self.on_released(block)

    def purge(self, match: Callable[[bytes], bool]) -> int:
        """Forget every cached block whose salt ``match`` accepts (a tenant's); a block
        a running request holds is freed when that request lets it go. Returns how
        many were forgotten."""
        blocks = [b for b, e in self._entries.items() if match(e.salt)]
        for block in blocks:
            self._uncache(block)
        return len(blocks)

    def evict(self, n: int) -> int:
        """Free up to ``n`` evictable blocks, each the least recently used of the tenant
        holding the most cached blocks; return how many."""
        freed = 0
        while freed < n and self._evictable:
            self._uncache(self._evictable.victim(self._held))
            freed += 1
        return freed

    def held_by(self, salt: bytes) -> int:
        """Cached blocks of the tenant ``salt`` belongs to (all its adapters)."""
        return self._held[tenant_of(salt)]

    def held_by_tenant(self) -> dict[str, int]:
        """Cached blocks per tenant name (safe from another thread: one C-level copy)."""
        return {tenant_name(scope): n for scope, n in self._held.copy().items()}

    def _uncache(self, block: int) -> None:
        """Forget a block and drop the cache's reference (freeing it if unused)."""
        entry = self._entries.pop(block)
        del self._by_key[entry.key]
        self.version += 1
        if self.events is not None:
            self.events.removed(entry.key)
        self._evictable.pop(block)
        scope = tenant_of(entry.salt)
        self._held[scope] -= 1
        if not self._held[scope]:
            del self._held[scope]
        self._stored.discard(block)
        self.allocator.decref(block)
