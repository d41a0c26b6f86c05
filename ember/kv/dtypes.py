"""The KV pool's storage dtypes: how one head's row of ``head_dim`` K or V values is held.

- ``f32``, ``f16``, ``bf16``: one float of that type per value; attention widens it to
  f32 exactly as it reads.
- ``q8_0``: llama.cpp's ``-ctk q8_0 -ctv q8_0`` (ggml's ``block_q8_0``): each head's
  row as blocks of 32 values, a block being its f16 scale ``d`` (2 bytes) followed by
  32 int8 codes — 34 bytes per 32 values, 0.53x of f16. Computed as llama.cpp's x86
  path computes it, in f32: ``amax = max |x|``, ``d = amax / 127``, codes
  ``round(x * (127 / amax))`` with ties to even (0 where ``amax`` is 0), then ``d``
  rounded to f16 (to nearest even). A value reads back as ``code * d``, which is
  exact in f32 (a 7-bit code times an 11-bit scale): the PyTorch path
  (``ember.models.layers.attention``) and the native one (``ember/kernels/paged_attention.h``)
  attend over the same numbers, and the native K/V write (``fused_decoder.h``)
  stores the same bytes as :meth:`KVDtype.encode`.

The pool tensor's element type names its format (each dtype has its own: q8_0's is
``uint8``), so code that gets only a view of the pool knows how to read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q8_0_BLOCK = 32  # values per q8_0 block
Q8_0_BYTES = 34  # bytes per q8_0 block: an f16 scale and 32 int8 codes


@dataclass(frozen=True)
class KVDtype:
    """One storage format of the KV pool: its name, the pool tensor's element type and
    the values per quantization block (1: a plain float per value)."""

    name: str
    storage: torch.dtype
    block: int = 1  # values per block; a head's row must hold whole blocks
    block_bytes: int = 0  # bytes per block (quantized formats)

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def fits(self, head_dim: int) -> bool:
        """Whether a head's row of ``head_dim`` values is whole blocks."""
        return head_dim > 0 and head_dim % self.block == 0

    def row_width(self, head_dim: int) -> int:
        """Elements of ``storage`` holding one head's row of ``head_dim`` values."""
        if not self.fits(head_dim):
            raise ValueError(f"KV dtype {self.name} stores rows in blocks of {self.block} "
                             f"values; head_dim {head_dim} is not a multiple of {self.block}")
        return head_dim // self.block * self.block_bytes if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage).element_size()

    def head_dim_of(self, width: int) -> int:
        """The values per row held in ``width`` storage elements (inverse of row_width)."""
        if not self.quantized:
            return width
        if width % self.block_bytes:
            raise ValueError(f"a {self.name} row of {width} bytes is not whole blocks")
        return width // self.block_bytes * self.block

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` (..., head_dim) of any float dtype as stored: (..., row_width)."""
        if self.quantized:
            return quantize_q8_0(x)
        return x.to(self.storage)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows (..., row_width) as (..., head_dim) values in ``dtype``."""
        if self.quantized:
            return dequantize_q8_0(stored).to(dtype)
        return stored.to(dtype)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """(..., n) values, n a multiple of 32, as (..., n / 32 * 34) q8_0 bytes."""
    n = x.shape[-1]
    if n % Q8_0_BLOCK:
        raise ValueError(f"q8_0 quantizes rows of whole 32-value blocks, got {n} values")
    blocks = x.float().reshape(*x.shape[:-1], n // Q8_0_BLOCK, Q8_0_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # Both divisions by full tensors: torch computes ``scalar / tensor`` as a reciprocal
    # times the scalar, and may divide by a scalar that way too (another rounding).
    d = amax / torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv).to(torch.int8)  # round: ties to even
    scale = d.to(torch.float16).view(torch.uint8)  # (..., blocks, 2): little-endian f16
    out = torch.cat([scale, codes.view(torch.uint8)], -1)
    return out.reshape(*x.shape[:-1], n // Q8_0_BLOCK * Q8_0_BYTES)


def dequantize_q8_0(stored: torch.Tensor) -> torch.Tensor:
    """(..., m * 34) q8_0 bytes as (..., m * 32) float32 values (exactly code * d)."""
    width = stored.shape[-1]
    if stored.dtype != torch.uint8 or width % Q8_0_BYTES:
        raise ValueError(f"q8_0 rows are whole 34-byte blocks of uint8, got {stored.dtype} "
                         f"rows of {width}")
    blocks = stored.reshape(*stored.shape[:-1], width // Q8_0_BYTES, Q8_0_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # (..., blocks, 1)
    codes = blocks[..., 2:].view(torch.int8).float()
    return (codes * scale).reshape(*stored.shape[:-1], width // Q8_0_BYTES * Q8_0_BLOCK)


KV_DTYPES: dict[str, KVDtype] = {
    "f32": KVDtype("f32", torch.float32),
    "f16": KVDtype("f16", torch.float16),
    "bf16": KVDtype("bf16", torch.bfloat16),
    "q8_0": KVDtype("q8_0", torch.uint8, Q8_0_BLOCK, Q8_0_BYTES),
}
_BY_STORAGE = {d.storage: d for d in KV_DTYPES.values()}
assert len(_BY_STORAGE) == len(KV_DTYPES), "each KV dtype needs its own storage type"


def kv_dtype(spec: str | torch.dtype | KVDtype) -> KVDtype:
    """The KV dtype named by ``spec``: a name (``"q8_0"``), a KVDtype, or the torch
    dtype of a float format (``torch.float16``) or of a pool tensor (``torch.uint8``)."""
    if isinstance(spec, KVDtype):
        return spec
    found = KV_DTYPES.get(spec) if isinstance(spec, str) else _BY_STORAGE.get(spec)
    if found is None:
        raise ValueError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, got {spec!r}")
    return found
