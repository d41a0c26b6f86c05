"""Paged KV cache: a preallocated pool of fixed-size blocks and per-sequence tables.

The pool holds, per layer, one key and one value tensor of ``num_blocks *
block_size`` slots. A sequence owns a :class:`BlockTable`: the ids of the blocks
that hold its positions ``0 .. kv_len-1`` in order. Position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``.

Blocks are reference counted so that several sequences can share a cached prefix
(the prefix cache holds references too). ``truncate(keep_len)`` is the one rewind
primitive: it drops positions and returns whole blocks past the new end.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ember.errors import EmberError
from ember.kv.dtypes import KV_DTYPES, KVDtype, kv_dtype

__all__ = ["KV_DTYPES", "BlockAllocator", "BlockTable", "KVStorage", "OutOfBlocks"]


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold ``n_tokens`` positions (the last one possibly part-filled)."""
    return -(-n_tokens // block_size)


class OutOfBlocks(EmberError):
    """The pool has no free block left; the scheduler preempts or waits."""


class KVStorage:
    """The pool: one tensor of shape (blocks, layers, 2, block_size, n_kv_heads, width),
    where ``width`` holds one head's row of ``head_dim`` values in the KV dtype's storage
    (``head_dim`` floats; q8_0: ``head_dim / 32 * 34`` bytes, see ember/kv/dtypes.py).

    A block — every layer's keys and values — is one contiguous unit, so it is copied
    out (to disk), in (a restore) or to another block with one operation. ``k[i]`` and
    ``v[i]`` are layer ``i``'s views of shape (blocks, block_size, n_kv_heads, width).
    The dtype is the storage's only: attention computes in the model's dtype.
    """

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype | KVDtype = "f32",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_dtype = kv_dtype(dtype)
        self.head_dim = head_dim
        # Uninitialized on purpose: pages are only touched once used, so a large pool
        # costs nothing up front. Every block is zeroed each time it is handed out
        # (``zero_blocks`` with ``BlockAllocator.take_unzeroed``), before its new owner
        # can read it: attention reads whole blocks, whose unwritten tail it masks out,
        # and a masked value still multiplies a zero weight (0 × NaN is NaN); and a
        # block freed by one request (one tenant) must not show its keys and values to
        # the next.
        width = self.kv_dtype.row_width(head_dim)
        self.pool = torch.empty((num_blocks, n_layers, 2, block_size, n_kv_heads, width),
                                dtype=self.kv_dtype.storage)
        self.k = [self.pool[:, i, 0] for i in range(n_layers)]
        self.v = [self.pool[:, i, 1] for i in range(n_layers)]

    @property
    def bytes_per_block(self) -> int:
        return self.pool[0].numel() * self.pool.element_size()

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero blocks handed to a new owner (every layer's keys and values)."""
        self.pool[torch.tensor(blocks, dtype=torch.long)] = 0

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's keys and values of block ``src`` into block ``dst``."""
        self.pool[dst] = self.pool[src]

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer ``layer``'s K and V (T, n_kv_heads, head_dim) of T positions
        (rounded or quantized to the KV dtype)."""
        self.k[layer][blocks, offsets] = self.kv_dtype.encode(k)
        self.v[layer][blocks, offsets] = self.kv_dtype.encode(v)

    def block_bytes(self, block: int) -> bytes:
        """Block ``block``'s keys and values, all layers, as bytes (one copy)."""
        return self.pool[block].view(torch.uint8).numpy().tobytes()

    def load_block(self, block: int, data: bytes | memoryview) -> None:
        """Fill block ``block`` from :meth:`block_bytes` output (one copy)."""
        self.pool[block].view(torch.uint8).view(-1).numpy()[:] = np.frombuffer(data, np.uint8)

    @staticmethod
    def bytes_per_block_of(
        n_layers: int, block_size: int, n_kv_heads: int, head_dim: int,
        dtype: str | torch.dtype | KVDtype,
    ) -> int:
        return 2 * n_layers * block_size * n_kv_heads * kv_dtype(dtype).row_bytes(head_dim)


class BlockAllocator:
    """Free list and reference counts for the pool's block ids."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # handed out since take_unzeroed(): never written, or holding a previous
        # owner's keys and values (an ordered set)
        self._unzeroed: dict[int, None] = {}

    def take_unzeroed(self) -> list[int]:
        """Blocks handed out since the last call whose memory is not known to be zero
        (never written, or a previous owner's): the storage zeroes them before anything
        reads them."""
        blocks, self._unzeroed = list(self._unzeroed), {}
        return blocks

    def filled(self, block: int) -> None:
        """The caller wrote all of ``block`` (a restore): it need not be zeroed."""
        self._unzeroed.pop(block, None)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.popleft()
        self.refcount[block] = 1
        self._unzeroed[block] = None
        return block

    def incref(self, block: int) -> None:
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; return True when the block became free."""
        rc = self.refcount[block] - 1
        if rc < 0:
            raise AssertionError(f"KV block {block} released more often than acquired")
        self.refcount[block] = rc
        if rc == 0:
            self._free.append(block)
            return True
        return False


class BlockTable:
    """One sequence's blocks. ``kv_len`` counts positions whose K/V are written.

    The block ids are kept in a growing tensor so that the slots of the whole context
    are computed with one vectorized expression, not a Python loop over positions.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: list[int] = []
        self._ids = torch.zeros(16, dtype=torch.long)
        self.kv_len = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def append_block(self, block: int) -> None:
        """Append a block the caller already holds a reference to."""
        n = len(self.blocks)
        if n == self._ids.numel():
            self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
        self._ids[n] = block
        self.blocks.append(block)

    def blocks_needed(self, n_tokens: int) -> int:
        """How many more blocks holding ``n_tokens`` positions in total would take."""
        return max(0, blocks_for(n_tokens, self.block_size) - len(self.blocks))

    def reserve(self, n_tokens: int) -> None:
        """Make room for positions ``0 .. n_tokens-1``; all or nothing."""
        need = self.blocks_needed(n_tokens)
        if need > self.allocator.num_free:
            raise OutOfBlocks(
                f"need {need} more KV blocks, {self.allocator.num_free} free"
            )
        for _ in range(need):
            self.append_block(self.allocator.allocate())

    def block_ids(self, end: int) -> torch.Tensor:
        """The blocks holding positions ``0 .. end-1`` (requires ``end <= capacity``)."""
        return self._ids[: blocks_for(end, self.block_size)]

    def truncate(self, keep_len: int) -> list[int]:
        """Rewind to the first ``keep_len`` positions; returns the blocks it let go."""
        if keep_len >= self.kv_len:
            return []
        self.kv_len = keep_len
        return self.release_past(keep_len)

    def release_past(self, n_tokens: int) -> list[int]:
        """Give back the blocks past those holding positions ``0 .. n_tokens-1`` (reserved
        for positions that were not kept, such as a rejected draft's); returns them."""
        keep = blocks_for(n_tokens, self.block_size)
        dropped = self.blocks[keep:]
        for block in dropped:
            self.allocator.decref(block)
        del self.blocks[keep:]
        return dropped

    def release(self) -> None:
        """Give every block back (the sequence is finished, aborted or preempted)."""
        for block in self.blocks:
            self.allocator.decref(block)
        self.blocks.clear()
        self.kv_len = 0
