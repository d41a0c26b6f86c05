"""paged_attention against dense causal attention computed row by row.

Decode rows, draft-verify rows of different lengths and prefill chunks share one
batch; each row must attend to exactly its own cached context and its earlier queries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native import build_variant, require_kernels

from ember.models.layers.attention import AttentionBatch, RowSpec, paged_attention

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


def scattered_rows(shapes: list[tuple[int, int]], perm: torch.Tensor) -> list[RowSpec]:
    """Rows of (start, q_len), each holding the next blocks of the shuffled ids ``perm``."""
    rows, used = [], 0
    for start, n in shapes:
        nb = -(-(start + n) // BLOCK)
        rows.append(RowSpec(perm[used:used + nb], start, n))
        used += nb
    return rows


def test_mixed_decode_verify_and_prefill_rows_match_dense_attention() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(9, 1), (2, 3), (13, 1), (0, 6), (5, 16), (7, 20), (30, 1), (3, 2)]  # (start, q_len)
    pool = 64
    k_cache = torch.randn(pool * BLOCK, HKV, D, generator=g)
    v_cache = torch.randn(pool * BLOCK, HKV, D, generator=g)
    rows = scattered_rows(shapes, torch.randperm(pool, generator=g))
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


# --------------------------------- the native kernel (the fused q4 stack's attention)
def pool_case(seed: int, shapes: list[tuple[int, int]], dtype: torch.dtype | str,
              layers: int = 3, head_dim: int = D):
    """A block-major pool (as KVStorage lays it out, random K/V stored in ``dtype``)
    and rows of (start, q_len)."""
    from ember.kv.blocks import KVStorage

    g = torch.Generator().manual_seed(seed)
    pool = 80
    storage = KVStorage(layers, pool, BLOCK, HKV, head_dim, dtype)
    values = torch.randn(*storage.pool.shape[:-1], head_dim, generator=g)
    storage.pool.copy_(storage.kv_dtype.encode(values))
    rows = scattered_rows(shapes, torch.randperm(pool, generator=g))
    q = torch.randn(sum(n for _, n in shapes), H, head_dim, generator=g)
    return storage, rows, q


def native_kernel():
    return require_kernels()


def native(mod, q, storage, layer: int, rows: list[RowSpec], window: int = 0) -> torch.Tensor:
    batch = AttentionBatch.build(rows, BLOCK)
    return mod.paged_attention(q, storage.pool, layer, batch.tables, batch.token_rows,
                               batch.positions, q.shape[-1] ** -0.5, window)


MIXED = [(9, 1), (2, 3), (13, 1), (0, 6), (5, 16), (7, 20), (30, 1), (0, 1), (3, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "q8_0"])
def test_native_attention_equals_the_pytorch_path(dtype):
    """Decode, verify and prefill rows, partial and whole last blocks, every pool dtype
    (q8_0: the native kernel reads the blocks in place, the PyTorch path dequantizes
    what it gathers; both attend over exactly code * scale)."""
    mod = native_kernel()
    storage, rows, q = pool_case(1, MIXED, dtype, head_dim=64 if dtype == "q8_0" else D)
    want = paged_attention(q, storage.k[1], storage.v[1], AttentionBatch.build(rows, BLOCK))
    got = native(mod, q, storage, 1, rows)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    assert not torch.equal(got, native(mod, q, storage, 0, rows))  # the layer is honoured


@pytest.mark.parametrize("dtype", [torch.float32, "q8_0"])
def test_native_attention_is_batch_and_chunk_invariant(dtype):
    """A query token's output is bitwise the same computed alone (as a decode row), in
    any chunk of its row's prefill, and beside any other rows, in any order."""
    mod = native_kernel()
    storage, rows, q = pool_case(2, [(0, 37), (0, 9), (0, 1), (0, 20)], dtype,
                                 head_dim=32 if dtype == "q8_0" else D)
    together = native(mod, q, storage, 2, rows)
    offsets = [0, 37, 46, 47]
    for (row, first) in zip(rows, offsets, strict=True):
        for chunk in (1, 3, 8, 16):  # the row's tokens in chunks of this size
            for start in range(0, row.q_len, chunk):
                n = min(chunk, row.q_len - start)
                spec = RowSpec(row.blocks, start, n)
                got = native(mod, q[first + start:first + start + n], storage, 2, [spec])
                assert torch.equal(got, together[first + start:first + start + n]), (chunk, start)
    order = [3, 0, 2, 1]
    flat = torch.cat([torch.arange(offsets[i], offsets[i] + rows[i].q_len) for i in order])
    again = native(mod, q[flat], storage, 2, [rows[i] for i in order])
    assert torch.equal(again, together[flat])


@pytest.mark.parametrize("dtype", [torch.float32, "q8_0"])
@pytest.mark.parametrize("window", [1, 5, 16, 21])
def test_native_sliding_window_equals_the_pytorch_path(window: int, dtype):
    """Windows shorter than, equal to and across block boundaries, on every row kind;
    positions before the window are never read (NaN there changes nothing; in q8_0
    bytes 0xFF: a NaN scale)."""
    mod = native_kernel()
    storage, rows, q = pool_case(5, MIXED, dtype, head_dim=32 if dtype == "q8_0" else D)
    batch = AttentionBatch.build(rows, BLOCK)
    want = paged_attention(q, storage.k[1], storage.v[1], batch, window=window)
    got = native(mod, q, storage, 1, rows, window)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    assert not torch.allclose(got, native(mod, q, storage, 1, rows))  # the window matters
    # (7, 20): its last token, at position 26, sees 27 - window positions onward only
    row, first = rows[5], sum(r.q_len for r in rows[:5])
    last = first + row.q_len - 1
    cut = 27 - window
    if cut > 0:
        for p in range(cut):
            block = row.blocks[p // BLOCK]
            storage.pool[block, 1, :, p % BLOCK] = 255 if dtype == "q8_0" else float("nan")
        again = native(mod, q[last:last + 1], storage, 1, [RowSpec(row.blocks, 26, 1)], window)
        assert torch.equal(again, got[last:last + 1])


def test_native_attention_reads_only_written_positions():
    """Positions past a token's own are never read: NaN there changes nothing."""
    mod = native_kernel()
    storage, rows, q = pool_case(3, [(0, 13)], torch.float32)
    before = native(mod, q, storage, 0, rows)
    last_block = rows[0].blocks[-1]
    storage.pool[last_block, :, :, 13 % BLOCK:] = float("nan")  # the unwritten tail
    assert torch.equal(native(mod, q, storage, 0, rows), before)


def test_native_attention_refuses_out_of_range_tables():
    mod = native_kernel()
    storage, rows, q = pool_case(4, [(0, 5)], torch.float32)
    batch = AttentionBatch.build(rows, BLOCK)
    bad = batch.tables.clone()
    bad[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="block id out of range"):
        mod.paged_attention(q, storage.pool, 0, bad, batch.token_rows, batch.positions, 0.3)
    with pytest.raises(RuntimeError, match="out of range"):
        mod.paged_attention(q, storage.pool, 0, batch.tables, batch.token_rows,
                            batch.positions + 100, 0.3)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["scalar", "avx2"])
def test_other_simd_builds_read_and_write_q8_0_pools_alike(variant: str, tiny32_loaded_q4):
    """The portable build and the plain-AVX2 one attend over a q8_0 pool as the native
    build does, and their fused stacks store the same q8_0 K/V bytes."""
    from ember.kv.blocks import KV_DTYPES, BlockAllocator, BlockTable
    from ember.models.decoder import native_decoder

    ext = native_kernel()
    mod = build_variant(variant)  # tests/test_quant_matmul.py builds the same ones
    assert mod.simd() == variant
    storage, rows, q = pool_case(6, MIXED, "q8_0", head_dim=64)
    want = paged_attention(q, storage.k[2], storage.v[2], AttentionBatch.build(rows, BLOCK))
    got = native(mod, q, storage, 2, rows)
    torch.testing.assert_close(got, native(ext, q, storage, 2, rows), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    model = tiny32_loaded_q4.model
    ids = list(range(100, 160))

    def layer0(stack, dtype: str) -> torch.Tensor:
        """Layer 0's K/V after a prefill of ``ids`` by ``stack``, in a pool of ``dtype``."""
        table = BlockTable(BlockAllocator(4), 16)
        table.reserve(len(ids))
        kv = model.new_kv_storage(4, 16, dtype)
        kv.zero_blocks(table.allocator.take_unzeroed())
        saved, model.native = model.native, stack
        try:
            model.forward(torch.tensor(ids), AttentionBatch.build(
                [RowSpec(table.block_ids(len(ids)), 0, len(ids))], 16), kv)
        finally:
            model.native = saved
        return kv.pool[:, 0]  # its K/V do not depend on the pool dtype

    # each build quantizes its own K/V to the bytes ember.kv.dtypes computes
    stack = native_decoder(model.cfg, model.layers, ext=mod)
    assert torch.equal(KV_DTYPES["q8_0"].encode(layer0(stack, "f32")), layer0(stack, "q8_0"))
