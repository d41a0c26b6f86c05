"""paged_attention against dense causal attention computed row by row.

Decode rows, draft-verify rows of different lengths and prefill chunks share one
batch; each row must attend to exactly its own cached context and its earlier queries.
"""

from __future__ import annotations

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
