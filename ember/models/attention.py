"""Attention over the paged KV cache for a flattened, variable-length batch.

A step's tokens from every scheduled sequence are concatenated into one flat batch
of ``T`` tokens. :class:`AttentionBatch` says, per sequence ("row"), which tokens
are its queries, where their K/V go, and which slots hold its whole context. It is
built once per step and shared by all layers.

:func:`paged_attention` is the one place that reads K/V through the block tables,
so a faster kernel can replace it alone. Rows decoding one token are attended
together in one padded call (the common case under load); prefill chunks, which
are few and long, are attended one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RowSpec:
    """One sequence's part of a step: ``q_len`` new tokens after ``start`` cached ones."""

    ctx_slots: torch.Tensor  # slots of positions 0 .. start+q_len-1
    start: int
    q_len: int


@dataclass
class _Prefill:
    q_index: slice
    ctx_slots: torch.Tensor
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, True = may attend; None: causal


@dataclass
class AttentionBatch:
    positions: torch.Tensor  # (T,) absolute position of each token
    slot_mapping: torch.Tensor  # (T,) slot each token's K/V is written to
    row_ends: torch.Tensor  # (R,) index of each row's last token in the flat batch
    decode_index: torch.Tensor  # (B,) flat indices of single-token rows
    decode_slots: torch.Tensor  # (B, L) context slots, padded
    decode_mask: torch.Tensor  # (B, 1, 1, L) bool
    prefills: list[_Prefill]

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    @classmethod
    def build(cls, rows: list[RowSpec]) -> AttentionBatch:
        positions, slot_mapping, row_ends = [], [], []
        decode_idx, decode_ctx, prefills = [], [], []
        offset = 0
        for row in rows:
            end = row.start + row.q_len
            positions.append(torch.arange(row.start, end))
            slot_mapping.append(row.ctx_slots[row.start : end])
            row_ends.append(offset + row.q_len - 1)
            if row.q_len == 1:
                decode_idx.append(offset)
                decode_ctx.append(row.ctx_slots[:end])
            else:
                # A chunk starting at position 0 is plain causal attention, which SDPA
                # runs with its fused kernel; a later chunk needs an explicit mask.
                mask = None
                if row.start:
                    q_pos = torch.arange(row.start, end)
                    mask = torch.arange(end)[None, :] <= q_pos[:, None]
                span = slice(offset, offset + row.q_len)
                prefills.append(_Prefill(span, row.ctx_slots[:end], mask))
            offset += row.q_len
        if decode_ctx:
            lengths = torch.tensor([c.numel() for c in decode_ctx])
            width = int(lengths.max())
            # Padding repeats the row's first slot (masked out) so that only slots the
            # row has written are ever read: the pool can start uninitialized.
            decode_slots = torch.stack([c[:1].expand(width) for c in decode_ctx])
            for i, c in enumerate(decode_ctx):
                decode_slots[i, : c.numel()] = c
            decode_mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]
        else:
            decode_slots = torch.zeros(0, 0, dtype=torch.long)
            decode_mask = torch.zeros(0, 1, 1, 0, dtype=torch.bool)
        return cls(
            positions=torch.cat(positions),
            slot_mapping=torch.cat(slot_mapping),
            row_ends=torch.tensor(row_ends),
            decode_index=torch.tensor(decode_idx, dtype=torch.long),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
        )


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """Causal attention of ``q`` (T, n_heads, head_dim) over each row's cached context.

    The batch's new K/V must already be written to the cache. Returns (T, n_heads, head_dim).
    """
    out = torch.empty_like(q)
    if batch.decode_index.numel():
        qd = q[batch.decode_index].unsqueeze(2)  # (B, H, 1, D)
        kd = k_cache[batch.decode_slots].transpose(1, 2)  # (B, Hkv, L, D)
        vd = v_cache[batch.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=batch.decode_mask, enable_gqa=True
        )
        out[batch.decode_index] = od.squeeze(2)
    for p in batch.prefills:
        qp = q[p.q_index].transpose(0, 1)  # (H, q_len, D)
        kp = k_cache[p.ctx_slots].transpose(0, 1)  # (Hkv, L, D)
        vp = v_cache[p.ctx_slots].transpose(0, 1)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask,
                                            is_causal=p.mask is None, enable_gqa=True)
        out[p.q_index] = op.transpose(0, 1)
    return out
