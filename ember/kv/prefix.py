"""Prefix cache: full KV blocks findable by the tokens they hold, scoped by a salt.

A block's key is a hash chain: ``key_i = H(key_{i-1}, tokens of block i)`` with
``key_{-1} = H(salt)``. The salt covers the tenant and the model fingerprint and is
supplied by whoever owns the request (the server derives it from the API key), so
two tenants never share keys and cannot observe each other's prefixes.

A hash hit is never trusted alone: the block's stored token ids must equal the
request's, so a collision can only cost a miss, never serve the wrong cache.

The cache holds one reference on each cached block. Blocks whose only reference is
the cache's are *evictable*; they sit in an LRU and are reclaimed only when the
pool runs out of free blocks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from ember.kv.blocks import BlockAllocator


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def root_key(salt: bytes) -> bytes:
    return hashlib.blake2b(b"ember-prefix-v1\0" + salt, digest_size=16).digest()


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens served from cache

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, salt: bytes, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks that prefixes ``tokens``.

        Returns the block ids (each with a new reference taken for the caller) and
        their chain keys.
        """
        bs = self.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        key = root_key(salt)
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_key(key, chunk)
            block = self._by_key.get(key)
            if block is None or self._tokens_of[block] != chunk:
                break
            self._evictable.pop(block, None)
            self.allocator.incref(block)
            blocks.append(block)
            keys.append(key)
        self.queries += len(tokens)
        self.hits += len(blocks) * bs
        return blocks, keys

    def insert(self, block: int, key: bytes, tokens: Sequence[int]) -> None:
        """Make a full, computed block findable. A key already present wins."""
        if key in self._by_key or block in self._key_of:
            return
        self._by_key[key] = block
        self._key_of[block] = key
        self._tokens_of[block] = tuple(tokens)
        self.allocator.incref(block)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def on_released(self, block: int) -> None:
        """A user dropped its reference; if only the cache holds it now, it is evictable."""
        if block in self._key_of and self.allocator.refcount[block] == 1:
            self._evictable[block] = None
            self._evictable.move_to_end(block)

    def evict(self, n: int) -> int:
        """Free up to ``n`` least recently used evictable blocks; return how many."""
        freed = 0
        while freed < n and self._evictable:
            block, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(block)
            del self._by_key[key]
            del self._tokens_of[block]
            self.allocator.decref(block)
            freed += 1
        return freed
