"""Block tables and the prefix cache, against brute-force oracles."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.kv.blocks import BlockAllocator, BlockTable, OutOfBlocks
from ember.kv.prefix import ROOT, PrefixCache, extend_keys


def test_slots_follow_the_block_table():
    alloc = BlockAllocator(8)
    t = BlockTable(alloc, block_size=4)
    alloc.allocate()  # block 0 taken by someone else
    t.reserve(10)
    assert t.blocks == [1, 2, 3]
    assert t.block_ids(10).tolist() == [1, 2, 3]
    from ember.models.layers.attention import AttentionBatch, RowSpec

    batch = AttentionBatch.build([RowSpec(t.block_ids(10), 3, 7)], block_size=4)
    assert batch.slot_mapping.tolist() == [7, 8, 9, 10, 11, 12, 13]  # positions 3..9


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
        assert len(t.blocks) == -(-t.kv_len // 4)
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


def _store(cache: PrefixCache, alloc: BlockAllocator, salt: bytes, tokens: list[int]) -> None:
    """Cache every full block of ``tokens`` as a finished request would leave them."""
    keys: list[bytes] = []
    extend_keys(keys, salt, tokens, cache.block_size)
    parent = ROOT
    for i, key in enumerate(keys):
        block = alloc.allocate()
        chunk = tokens[i * cache.block_size:(i + 1) * cache.block_size]
        serial = cache.insert(block, key, parent, salt, chunk, keys[i - 1] if i else b"")
        alloc.decref(block)
        cache.on_released(block)
        if serial is None:
            return
        parent = serial


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
        _store(cache, alloc, salt, tokens)
    salt, tokens = query
    assert len(cache.lookup(salt, tokens)) == _brute_force_hit(seqs, salt, tokens, bs)


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.sampled_from([b"a", b"b"]),
                            st.lists(st.integers(0, 2), min_size=0, max_size=10)),
                  min_size=1, max_size=8),
    query=st.tuples(st.sampled_from([b"a", b"b"]), st.lists(st.integers(0, 2), max_size=10)),
)
def test_hash_collisions_never_serve_another_chain(seqs, query):
    """With every key colliding, a hit is still only what the same salt and tokens
    computed (the brute-force oracle bounds it); collisions may only cost misses."""
    import ember.kv.prefix as prefix

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefix, "chain_key", lambda parent, tokens: b"one-key-for-all")
        bs = 2
        alloc = BlockAllocator(1000)
        cache = PrefixCache(alloc, bs)
        for salt, tokens in seqs:
            _store(cache, alloc, salt, tokens)
        salt, tokens = query
        assert len(cache.lookup(salt, tokens)) <= _brute_force_hit(seqs, salt, tokens, bs)


def test_a_colliding_key_from_another_tenant_is_a_miss(monkeypatch):
    import ember.kv.prefix as prefix

    # keys depend on the tokens only, so tenant B's first block has tenant A's key
    monkeypatch.setattr(prefix, "chain_key", lambda parent, tokens: bytes(tokens))
    alloc = BlockAllocator(8)
    cache = PrefixCache(alloc, 2)
    _store(cache, alloc, b"tenant-a", [1, 2, 3, 4])
    assert len(cache.lookup(b"tenant-a", [1, 2, 3, 4])) == 2
    assert cache.lookup(b"tenant-b", [1, 2, 3, 4]) == []


def test_a_chain_recomputed_after_its_head_was_evicted_is_cached_again():
    alloc = BlockAllocator(3)
    cache = PrefixCache(alloc, 1)
    _store(cache, alloc, b"s", [7, 8])
    assert cache.evict(1) == 1  # the head goes first (LRU); its child is an orphan now
    assert cache.lookup(b"s", [7, 8]) == []
    _store(cache, alloc, b"s", [7, 8])  # recomputed: the orphan's key is taken over
    assert len(cache.lookup(b"s", [7, 8])) == 2


def test_eviction_is_lru_and_only_under_pressure():
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc, 1)
    for i, tok in enumerate([10, 20, 30]):
        _store(cache, alloc, b"s", [tok])
        assert cache.num_evictable == i + 1
    assert alloc.num_free == 1  # cached blocks are not free until evicted
    hit = cache.lookup(b"s", [10])  # touch the oldest: it leaves the LRU while in use
    cache.acquire(hit, 1)
    assert [h.block for h in hit] == [0] and cache.num_evictable == 2
    assert cache.evict(1) == 1  # evicts block 1 (token 20), the least recently used
    assert cache.lookup(b"s", [20]) == []
    assert alloc.num_free == 2


class _Seq:
    """The least a KV sequence is (ember.kv.manager.KVSequence), for the manager alone."""

    def __init__(self, rid: str, tokens: list[int], manager) -> None:
        self.request_id, self.token_ids, self.salt = rid, tokens, b"tenant"
        self.block_table = manager.new_table()
        self.block_hashes: list[bytes] = []
        self.cached_tokens = 0
        self.state_slot: int | None = None
        self.state_restore: bytes | None = None
        self.num_output = 0
        self.wants_prompt_logprobs = False

    @property
    def kv_len(self) -> int:
        return self.block_table.kv_len


def test_a_waiting_sequence_is_looked_up_once_a_step_until_the_cache_changes():
    from ember.kv.manager import KVCacheManager

    kv = KVCacheManager(16, 4)
    first = _Seq("a", list(range(10, 23)), kv)  # 3 full blocks and a token
    kv.admit(first, [], 13)
    first.block_table.kv_len = 12  # as if its prompt were computed
    kv.register_computed(first)
    calls = []
    real = kv.prefix.lookup
    kv.prefix.lookup = lambda *a, **k: calls.append(1) or real(*a, **k)

    waiting = _Seq("b", list(range(10, 23)) + [99], kv)
    kv.begin_step()
    assert kv.cached_estimate(waiting) == 12  # predictions,
    assert not kv.loading(waiting)  # the disk prefetch check,
    assert len(kv.probe_prefix(waiting)) == 3  # and admission share one lookup
    assert len(calls) == 1
    kv.begin_step()
    kv.probe_prefix(waiting)
    assert len(calls) == 2  # a new step looks again
    kv.prefix.evict(16)  # the cache changed: what was found may be gone
    kv.free(first)
    kv.prefix.evict(16)
    assert kv.probe_prefix(waiting) == [] and len(calls) == 3
