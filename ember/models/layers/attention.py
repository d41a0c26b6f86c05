"""Attention over the paged KV cache for a flattened, variable-length batch.

A step's tokens from every scheduled sequence are concatenated into one flat batch
of ``T`` tokens. :class:`AttentionBatch` says, per sequence ("row"), which tokens
are its queries, where their K/V go, and which blocks hold its whole context. It is
built once per step and shared by all layers.

:func:`paged_attention` is the PyTorch path, the oracle: the f32 model uses it, and
the native decoder's attention (``ember/kernels/paged_attention.h``, which reads the
blocks in place, token by token in a fixed order) is tested against it. Context is
gathered a block at a time (``index_select`` over the pool viewed as blocks): one
index per block rather than per position copies whole contiguous blocks, 4.4x faster
than a per-slot gather at 6 rows × 352 positions. Rows decoding one token are
attended together in one padded call, rows verifying a few draft tokens in another
(padded to the longest draft: kept apart, one long draft does not multiply every
decode row's attention); prefill chunks, which are few and long, one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from ember.kv.dtypes import kv_dtype


@dataclass(frozen=True)
class RowSpec:
    """One sequence's part of a step: ``q_len`` new tokens after ``start`` cached ones."""

    blocks: torch.Tensor  # block ids holding positions 0 .. start+q_len-1, in order
    start: int
    q_len: int
    state: int = -1  # the sequence's recurrent-state slot (hybrid models); -1: none
    # (index of a query token, snapshot slot): its recurrent state after that token is
    # copied to the slot (hybrid models' prefix cache); None: no snapshot
    snapshot: tuple[int, int] | None = None


@dataclass
class _Prefill:
    q_index: slice
    blocks: torch.Tensor  # the row's context blocks
    ctx_len: int
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, True = may attend; None: causal
    start: int  # position of the chunk's first query
    # windowed masks by window, built once per step for all the layers that share one
    _windows: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def windowed(self, window: int) -> torch.Tensor | None:
        """The mask for a sliding-window layer (None where no query reaches past it)."""
        if self.ctx_len <= window:
            return self.mask
        if window not in self._windows:
            pos = torch.arange(self.start, self.ctx_len)[:, None]
            key = torch.arange(self.ctx_len)[None, :]
            self._windows[window] = (key <= pos) & (key > pos - window)
        return self._windows[window]


SHORT_QUERY = 16  # rows with at most this many query tokens are attended together


@dataclass
class _ShortRows:
    """Short rows attended in one padded call (queries padded to the longest row's)."""

    index: torch.Tensor  # (B, Q) flat indices of the rows' queries, padded
    valid: torch.Tensor  # (B, Q) bool: which of them are real
    blocks: torch.Tensor  # (B, NB) context blocks, padded
    mask: torch.Tensor  # (B, 1, Q, NB * block_size) bool
    query_pos: torch.Tensor  # (B, Q) positions of the (padded) queries
    # windowed masks by window, built once per step for all the layers that share one
    _windows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def windowed(self, window: int) -> torch.Tensor:
        """The mask for a sliding-window layer: also no key ``window`` or more back."""
        if window not in self._windows:
            key_pos = torch.arange(self.mask.shape[-1])
            recent = key_pos[None, None, :] > self.query_pos[:, :, None] - window
            self._windows[window] = self.mask & recent[:, None]
        return self._windows[window]


class AttentionBatch:
    """One step's attention metadata, shared by every layer.

    Per token: ``positions``, ``slot_mapping`` (where its K/V go) and ``token_rows``
    (its row); per row: ``tables`` (its block ids, padded with its first block) and
    ``row_ends``. ``short`` and ``prefills`` group the rows for the PyTorch path and
    are built on first use: the native path reads the per-token fields only.
    """

    def __init__(self, rows: list[RowSpec], block_size: int) -> None:
        self.rows = rows
        self.block_size = block_size
        self.lora: Any = None  # the step's LoRA adapters (ember.models.lora.LoRABatch), if any
        positions, row_ends, token_rows = [], [], []
        offset = 0
        for i, row in enumerate(rows):
            if row.blocks.numel() * block_size < row.start + row.q_len:
                raise ValueError(f"row {i}: {row.blocks.numel()} blocks cannot hold "
                                 f"{row.start + row.q_len} positions")
            positions.append(torch.arange(row.start, row.start + row.q_len))
            token_rows.append(torch.full((row.q_len,), i, dtype=torch.long))
            offset += row.q_len
            row_ends.append(offset - 1)
        width = max(row.blocks.numel() for row in rows)
        self.tables = torch.stack([torch.cat((row.blocks, row.blocks[:1].expand(
            width - row.blocks.numel()))) for row in rows])
        self.positions = torch.cat(positions)
        self.token_rows = torch.cat(token_rows)
        self.slot_mapping = (self.tables[self.token_rows, self.positions // block_size]
                             * block_size + self.positions % block_size)
        self.row_ends = torch.tensor(row_ends)

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    def token_snapshots(self) -> torch.Tensor | None:
        """Per token, the snapshot slot its row's recurrent state goes to after it (-1:
        none); None when no row asks for one."""
        if all(row.snapshot is None for row in self.rows):
            return None
        out = torch.full((self.num_tokens,), -1, dtype=torch.long)
        offset, slots = 0, set()
        for row in self.rows:
            if row.snapshot is not None:
                index, slot = row.snapshot
                if not 0 <= index < row.q_len:
                    raise ValueError(f"snapshot after query token {index} of a row of "
                                     f"{row.q_len}")
                if slot in slots:  # two rows would write one slot in the same step
                    raise ValueError(f"snapshot slot {slot} asked for by two rows")
                slots.add(slot)
                out[offset + index] = slot
            offset += row.q_len
        return out

    @classmethod
    def build(cls, rows: list[RowSpec], block_size: int) -> AttentionBatch:
        return cls(rows, block_size)

    @cached_property
    def short(self) -> list[_ShortRows]:
        """Rows of up to SHORT_QUERY query tokens, attended in padded calls: one for the
        decode rows, one for the draft-verify rows, so that one request's draft does not
        pad every decode row to its length."""
        decode, verify, offset = [], [], 0
        for row in self.rows:
            if row.q_len == 1:
                decode.append((offset, row))
            elif row.q_len <= SHORT_QUERY:
                verify.append((offset, row))
            offset += row.q_len
        return [_short_rows(g, self.block_size) for g in (decode, verify) if g]

    @cached_property
    def prefills(self) -> list[_Prefill]:
        """Longer prefill chunks, attended one by one."""
        prefills, offset = [], 0
        for row in self.rows:
            if row.q_len > SHORT_QUERY:
                end = row.start + row.q_len
                # A chunk starting at position 0 is plain causal attention, which SDPA
                # runs with its fused kernel; a later chunk needs an explicit mask.
                mask = None
                if row.start:
                    pos = torch.arange(row.start, end)
                    mask = torch.arange(end)[None, :] <= pos[:, None]
                span = slice(offset, offset + row.q_len)
                prefills.append(_Prefill(span, row.blocks, end, mask, row.start))
            offset += row.q_len
        return prefills


def _short_rows(short: list[tuple[int, RowSpec]], block_size: int) -> _ShortRows:
    q = max(row.q_len for _, row in short)
    width = max(row.blocks.numel() for _, row in short)
    steps = torch.arange(q)
    # Padding repeats a row's last query and first block (both masked or dropped), so
    # only blocks the row has written are ever read: the pool can start uninitialized.
    lens = torch.tensor([row.q_len for _, row in short])
    starts = torch.tensor([row.start for _, row in short])
    first = torch.tensor([offset for offset, _ in short])
    index = first[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)
    valid = steps[None, :] < lens[:, None]
    blocks = torch.stack([row.blocks[:1].expand(width) for _, row in short])
    for i, (_, row) in enumerate(short):
        blocks[i, : row.blocks.numel()] = row.blocks
    query_pos = starts[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)  # (B, Q)
    key_pos = torch.arange(width * block_size)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal, within written slots
    return _ShortRows(index, valid, blocks, mask[:, None], query_pos)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V of ``blocks`` (any shape of block ids) as (*blocks.shape[:-1], L, H, D) in
    ``dtype``; ``cache`` is one layer's (num_blocks, block_size, H, width) view of the
    pool, its rows stored in the KV dtype its element type names (q8_0: dequantized)."""
    out = kv_dtype(cache.dtype).decode(torch.index_select(cache, 0, blocks.reshape(-1)), dtype)
    return out.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *out.shape[2:])


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None, softcap: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale [soft-capped], masked [, sink]) · v over (..., H, Q, D) queries
    and (..., Hkv, L, D) keys; no mask: causal with the queries at the end. ``sinks``
    (H,): a logit per head that joins each softmax's denominator and attends to
    nothing (gpt-oss)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              is_causal=mask is None, enable_gqa=True)
    # SDPA has neither: the same computation spelled out (Gemma 2, gpt-oss)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        qn, kn = q.shape[-2], k.shape[-2]
        mask = torch.ones(qn, kn, dtype=torch.bool).tril(kn - qn)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
    window: int | None = None, scale: float | None = None, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (T, n_heads, head_dim) over each row's cached context.

    ``k_cache`` and ``v_cache`` are one layer's (num_blocks, block_size, n_kv_heads,
    width) views of the KV pool, in any KV dtype (ember/kv/dtypes.py; q8_0 rows are
    dequantized as they are gathered). The batch's new K/V must already be
    written to them. ``window``: a sliding-window layer's span (a query at position p
    sees positions p - window + 1 .. p); ``scale``: of q·k (default 1/sqrt(head_dim));
    ``softcap`` > 0: scores s become softcap·tanh(s/softcap) before the softmax;
    ``sinks`` (n_heads,): each head's logit that joins the softmax (gpt-oss).
    Returns (T, n_heads, head_dim) in ``q``'s dtype.
    """
    out = torch.empty_like(q)
    dt = q.dtype
    for g in batch.short:
        qs = q[g.index].transpose(1, 2)  # (B, H, Q, D)
        ks = _gather(k_cache, g.blocks, dt).transpose(1, 2)  # (B, Hkv, L, D)
        vs = _gather(v_cache, g.blocks, dt).transpose(1, 2)
        mask = g.mask if window is None else g.windowed(window)
        os_ = _attention(qs, ks, vs, mask, scale, softcap, sinks).transpose(1, 2)  # (B,Q,H,D)
        out[g.index[g.valid]] = os_[g.valid]
    for p in batch.prefills:
        qp = q[p.q_index].transpose(0, 1)  # (H, q_len, D)
        kp = _gather(k_cache, p.blocks, dt)[: p.ctx_len].transpose(0, 1)  # (Hkv, L, D)
        vp = _gather(v_cache, p.blocks, dt)[: p.ctx_len].transpose(0, 1)
        mask = p.mask if window is None else p.windowed(window)
        op = _attention(qp, kp, vp, mask, scale, softcap, sinks)
        out[p.q_index] = op.transpose(0, 1)
    return out
