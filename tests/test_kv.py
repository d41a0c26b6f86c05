"""Block tables and the prefix cache, against brute-force oracles."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.kv.blocks import BlockAllocator, BlockTable, OutOfBlocks
from ember.kv.prefix import PrefixCache, chain_key, root_key


def test_slots_follow_the_block_table():
    alloc = BlockAllocator(8)
    t = BlockTable(alloc, block_size=4)
    alloc.allocate()  # block 0 taken by someone else
    t.reserve(10)
    assert t.blocks == [1, 2, 3]
    assert t.slots(10).tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]


def test_reserve_is_all_or_nothing():
    alloc = BlockAllocator(3)
    t = BlockTable(alloc, block_size=4)
    with pytest.raises(OutOfBlocks):
        t.reserve(13)
    assert alloc.num_free == 3 and t.blocks == []


@given(ops=st.lists(st.tuples(st.sampled_from(["grow", "truncate"]), st.integers(0, 40)),
                    max_size=30))
def test_truncate_frees_exactly_the_blocks_past_the_new_end(ops):
    alloc = BlockAllocator(16)
    t = BlockTable(alloc, block_size=4)
    for op, n in ops:
        if op == "grow" and n > t.kv_len:
            t.reserve(n)
            t.kv_len = n
        elif op == "truncate":
            t.truncate(n)
        assert len(t.blocks) == -(-t.kv_len // 4) or op == "grow"
        assert alloc.num_free == 16 - len(t.blocks)
    t.release()
    assert alloc.num_free == 16 and all(rc == 0 for rc in alloc.refcount)


def _brute_force_hit(stored: list[tuple[bytes, list[int]]], salt: bytes, tokens: list[int],
                     bs: int) -> int:
    """Blocks of ``tokens`` served by some stored sequence with the same salt."""
    best = 0
    for s_salt, s_tokens in stored:
        if s_salt != salt:
            continue
        n = 0
        while (n + 1) * bs <= min(len(tokens), len(s_tokens)) and \
                tokens[n * bs:(n + 1) * bs] == s_tokens[n * bs:(n + 1) * bs]:
            n += 1
        best = max(best, n)
    return best


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.sampled_from([b"a", b"b"]),
                            st.lists(st.integers(0, 3), min_size=0, max_size=14)),
                  min_size=1, max_size=8),
    query=st.tuples(st.sampled_from([b"a", b"b"]), st.lists(st.integers(0, 3), max_size=14)),
)
def test_lookup_matches_brute_force_longest_cached_prefix(seqs, query):
    bs = 2
    alloc = BlockAllocator(1000)
    cache = PrefixCache(alloc, bs)
    for salt, tokens in seqs:  # store every full block of every sequence
        key = root_key(salt)
        for i in range(len(tokens) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            key = chain_key(key, chunk)
            block = alloc.allocate()
            cache.insert(block, key, chunk)
            alloc.decref(block)
            cache.on_released(block)
    salt, tokens = query
    blocks, _ = cache.lookup(salt, tokens)
    assert len(blocks) == _brute_force_hit(seqs, salt, tokens, bs)


def test_eviction_is_lru_and_only_under_pressure():
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc, 1)
    for i, tok in enumerate([10, 20, 30]):
        b = alloc.allocate()
        cache.insert(b, chain_key(root_key(b"s"), [tok]), [tok])
        alloc.decref(b)
        cache.on_released(b)
        assert cache.num_evictable == i + 1
    assert alloc.num_free == 1  # cached blocks are not free until evicted
    hit, _ = cache.lookup(b"s", [10])  # touch the oldest: it leaves the LRU while in use
    assert hit == [0] and cache.num_evictable == 2
    assert cache.evict(1) == 1  # evicts block 1 (token 20), the least recently used
    assert cache.lookup(b"s", [20])[0] == []
    assert alloc.num_free == 2
