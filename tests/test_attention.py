"""paged_attention against dense causal attention computed row by row.

Decode rows, draft-verify rows of different lengths and prefill chunks share one
batch; each row must attend to exactly its own cached context and its earlier queries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.models.attention import AttentionBatch, RowSpec, paged_attention

BLOCK = 4
H, HKV, D = 4, 2, 8


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of q (n, H, D) at positions start.. over k, v (start+n, HKV, D)."""
    rep = H // HKV
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    pos_q = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), v)


def test_mixed_decode_verify_and_prefill_rows_match_dense_attention() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(9, 1), (2, 3), (13, 1), (0, 6), (5, 16), (7, 20), (30, 1), (3, 2)]  # (start, q_len)
    pool = 64
    k_cache = torch.randn(pool * BLOCK, HKV, D, generator=g)
    v_cache = torch.randn(pool * BLOCK, HKV, D, generator=g)
    perm = torch.randperm(pool, generator=g)
    rows, used = [], 0
    for start, n in shapes:
        nb = -(-(start + n) // BLOCK)
        rows.append(RowSpec(perm[used:used + nb], start, n))
        used += nb
    batch = AttentionBatch.build(rows, BLOCK)
    assert len(batch.short) == 2  # decode rows and verify rows apart
    q = torch.randn(batch.num_tokens, H, D, generator=g)
    out = paged_attention(q, k_cache.view(pool, BLOCK, HKV, D), v_cache.view(pool, BLOCK, HKV, D),
                          batch)
    offset = 0
    for row in rows:
        slots = (row.blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
        slots = slots[: row.start + row.q_len]
        want = dense(q[offset:offset + row.q_len], k_cache[slots], v_cache[slots], row.start)
        torch.testing.assert_close(out[offset:offset + row.q_len], want, atol=1e-5, rtol=1e-5)
        offset += row.q_len


# ------------------------------------------------- the native decode kernel (q4's path)
def decode_case(seed: int, lens: list[int], layers: int = 3):
    """A block-major pool (as KVStorage lays it out), one layer's views, decode rows."""
    from ember.kv.blocks import KVStorage

    g = torch.Generator().manual_seed(seed)
    pool = 80
    storage = KVStorage(layers, pool, BLOCK, HKV, D)
    storage.pool.copy_(torch.randn(storage.pool.shape, generator=g))
    perm = torch.randperm(pool, generator=g)
    rows, used = [], 0
    for n in lens:
        nb = -(-n // BLOCK)
        rows.append(RowSpec(perm[used:used + nb], n - 1, 1))
        used += nb
    q = torch.randn(len(lens), H, D, generator=g)
    return storage, rows, q


def native_kernel():
    from ember import kernels

    mod = kernels.quant_matmul()
    if mod is None:
        pytest.skip(f"native kernel unavailable: {kernels.unavailable_reason()}")
    return mod


def test_native_decode_attention_equals_the_pytorch_path():
    mod = native_kernel()
    lens = [1, 3, 4, 5, 17, 40, 2, 33]  # partial and whole last blocks, one position
    storage, rows, q = decode_case(1, lens)
    batch = AttentionBatch.build(rows, BLOCK)
    k, v = storage.k[1], storage.v[1]  # a strided view: layer 1 of the block-major pool
    want = paged_attention(q, k, v, batch)
    got = paged_attention(q, k, v, batch, mod.paged_decode_attention)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))


def test_native_decode_attention_is_batch_invariant():
    """A row's output is bitwise the same alone and beside any other rows."""
    mod = native_kernel()
    lens = [9, 1, 30, 16, 5]
    storage, rows, q = decode_case(2, lens)
    k, v = storage.k[0], storage.v[0]
    together = paged_attention(q, k, v, AttentionBatch.build(rows, BLOCK),
                               mod.paged_decode_attention)
    for i, row in enumerate(rows):
        alone = paged_attention(q[i:i + 1], k, v, AttentionBatch.build([row], BLOCK),
                                mod.paged_decode_attention)
        assert torch.equal(alone[0], together[i]), i
    reordered = [rows[j] for j in (4, 2, 0, 3, 1)]
    again = paged_attention(q[[4, 2, 0, 3, 1]], k, v, AttentionBatch.build(reordered, BLOCK),
                            mod.paged_decode_attention)
    assert torch.equal(again, together[[4, 2, 0, 3, 1]])
