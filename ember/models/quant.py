"""Dequantize ggml tensor formats to float32, vectorized over whole tensors.

Every block format is handled in two steps. An ``*_unpack`` function splits the
raw bytes into integer codes plus per-group float scales (and offsets), shaped
``[rows, groups, group_size]`` / ``[rows, groups]``; ``dequantize`` then applies
``q * scale (+/- offset)``. The unpackers are public because fused
quantized-matmul kernels want the codes and scales, not the float weights, and
keeping one unpacker per format gives one source of truth for each byte layout.

The bit twiddling runs in numpy rather than torch: numpy is single-threaded and
so immune to intra-op thread contention, which on a busy 2-core machine made
torch's small elementwise kernels 10-100x slower; on an idle machine the two are
about equally fast for these memory-bound ops. Results are handed over as torch
tensors sharing the numpy buffers (no copy).

The float arithmetic is done in the same order as gguf-py's reference
dequantizers (f16 fields widened to f32 first, scale products formed before
multiplying the codes, no fused multiply-add), so results agree bit for bit.

Raw bytes are assumed little-endian, as GGUF files are on every platform ember
targets. Tensors are stored row-major with rows of ``shape[-1]`` elements, and a
row always holds a whole number of blocks, so blocks never straddle rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ember.errors import GGUFError, UnsupportedModelError
from ember.models.gguf import BLOCK_GEOMETRY, GGMLType

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(
    {
        GGMLType.F32,
        GGMLType.F16,
        GGMLType.BF16,
        GGMLType.Q8_0,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q2_K,
        GGMLType.Q3_K,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
        GGMLType.IQ4_NL,
        GGMLType.IQ4_XS,
        GGMLType.MXFP4,
    }
)

RawBytes = np.ndarray | torch.Tensor
Unpacked = tuple[np.ndarray, ...]

_SHIFTS_8 = np.arange(8, dtype=np.uint8)  # every bit position in a byte
_SHIFTS_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)  # the four 2-bit fields of a byte


# ------------------------------------------------------------------ input helpers


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"type#{ggml_type}"


def _as_u8(raw: RawBytes) -> np.ndarray:
    """A flat uint8 numpy view of ``raw``. Read-only input is fine: nothing here writes."""
    arr = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if arr.dtype != np.uint8:
        raise TypeError(f"raw bytes must be uint8, got {arr.dtype}")
    return arr.reshape(-1)


def block_view(
    raw: RawBytes, ggml_type: GGMLType, shape: tuple[int, ...], name: str | None = None
) -> np.ndarray:
    """A quantized tensor's bytes as ``[rows, blocks_per_row, bytes_per_block]`` (a view),
    its size checked against its type and shape: the one reading of GGUF blocks that the
    dequantizer and the packed layouts share."""
    block_elems, block_bytes = BLOCK_GEOMETRY[ggml_type]
    row_len = shape[-1] if shape else 1
    n_elements = int(np.prod(shape, dtype=np.int64))
    what = f"tensor {name!r}" if name else "tensor"
    if row_len % block_elems:
        raise GGUFError(
            f"{what}: row length {row_len} is not a multiple of the "
            f"{ggml_type.name} block size {block_elems}"
        )
    u8 = _as_u8(raw)
    expected = n_elements // block_elems * block_bytes
    if u8.size != expected:
        raise GGUFError(
            f"{what}: {ggml_type.name} shape {shape} needs {expected} bytes, got {u8.size}"
        )
    rows = n_elements // row_len if row_len else 0
    return u8.reshape(rows, row_len // block_elems, block_bytes)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte ``start`` of every block, widened to f32 (exact).

    Every block size and f16 field offset used by ggml is even, so the block array
    can be reinterpreted as f16 wholesale and the field picked as one column.
    """
    return blocks.view(np.float16)[..., start // 2].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Split ``[..., k]`` bytes into ``[..., 2k]`` codes: all low nibbles, then all high."""
    k = packed.shape[-1]
    out = np.empty((*packed.shape[:-1], 2 * k), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[..., :k])
    np.right_shift(packed, 4, out=out[..., k:])
    return out


def _bits(packed: np.ndarray) -> np.ndarray:
    """Expand ``[..., k]`` bytes to ``[..., 8k]`` 0/1 values, LSB of byte 0 first."""
    bits = (packed[..., None] >> _SHIFTS_8) & 1
    return bits.reshape(*packed.shape[:-1], -1)


# ---------------------------------------------------------------- 32-element blocks
#
# The legacy formats quantize 32 consecutive elements per block. All start with an
# f16 scale d; the "_1" variants add an f16 offset m (the block minimum) so that
# unsigned codes can cover asymmetric ranges. 4-bit codes are packed two per byte,
# element j in the low nibble of byte j and element j+16 in the high nibble (so
# SIMD code unpacks a block with one mask and one shift). The 5-bit formats keep
# that nibble array and store the 32 fifth bits in a 4-byte little-endian bitmask
# qh, bit j belonging to element j. qh is only 2-byte aligned inside a block, so it
# is decoded byte by byte instead of as a u32.


def _q8_0(blk: np.ndarray) -> Unpacked:
    # d: f16, then 32 int8 codes; value = q * d
    return blk[..., 2:].view(np.int8), _f16_field(blk, 0)


def _q4_0(blk: np.ndarray) -> Unpacked:
    # d: f16, 16 bytes of nibbles; value = (nibble - 8) * d
    q = _nibbles(blk[..., 2:]).view(np.int8)
    q -= 8
    return q, _f16_field(blk, 0)


def _q4_1(blk: np.ndarray) -> Unpacked:
    # d: f16, m: f16, 16 bytes of nibbles; value = q * d + m
    return _nibbles(blk[..., 4:]), _f16_field(blk, 0), _f16_field(blk, 2)


def _q5_0(blk: np.ndarray) -> Unpacked:
    # d: f16, qh: 4 bytes, 16 bytes of nibbles; value = (q - 16) * d
    q = _nibbles(blk[..., 6:])
    q |= _bits(blk[..., 2:6]) << 4
    q = q.view(np.int8)
    q -= 16
    return q, _f16_field(blk, 0)


def _q5_1(blk: np.ndarray) -> Unpacked:
    # d: f16, m: f16, qh: 4 bytes, 16 bytes of nibbles; value = q * d + m
    q = _nibbles(blk[..., 8:])
    q |= _bits(blk[..., 4:8]) << 4
    return q, _f16_field(blk, 0), _f16_field(blk, 2)


# ------------------------------------------------------------------------ K-quants
#
# K-quants use 256-element super-blocks split into sub-blocks, and spend fewer bits
# on per-sub-block scales by quantizing the scales themselves against one f16
# super-scale. The unpackers resolve that two-level scheme, so callers see plain
# per-group float scales just like the 32-element formats.
#
# Q4_K / Q5_K: d, dmin (f16), 12 bytes holding eight 6-bit scales and eight 6-bit
# mins, then the codes. Sub-block j (32 elements) has value = d*sc[j]*q - dmin*mn[j].
# The first four scales/mins sit in the low 6 bits of bytes 0-3 / 4-7; the last four
# take their low 4 bits from bytes 8-11 (scale in the low nibble, min in the high)
# and their top 2 bits from the otherwise unused top bits of bytes 0-3 / 4-7.
# Codes: 128 bytes in four 32-byte chunks; chunk c's low nibbles are sub-block 2c
# and its high nibbles sub-block 2c+1 (again one mask and one shift per chunk).
# Q5_K puts 32 bytes qh before the codes, where bit i of qh[l] is the fifth bit of
# element l of sub-block i.


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode the 12-byte Q4_K/Q5_K scale field into ``[..., 8]`` 6-bit scales and mins."""
    lo_sc, lo_mn, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)), axis=-1)
    mn = np.concatenate((lo_mn & 0x3F, (hi >> 4) | ((lo_mn >> 6) << 4)), axis=-1)
    return sc, mn


def _k_group_scales(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-32-element scale ``d*sc`` and minimum ``dmin*mn``, as ``[rows, n/32]``."""
    rows, n_super = blk.shape[:2]
    sc, mn = _k_scales_mins(blk[..., 4:16])
    scale = _f16_field(blk, 0)[..., None] * sc.astype(np.float32)
    minimum = _f16_field(blk, 2)[..., None] * mn.astype(np.float32)
    return scale.reshape(rows, n_super * 8), minimum.reshape(rows, n_super * 8)


def _k_codes4(qs: np.ndarray) -> np.ndarray:
    """``[rows, S, 128]`` packed nibbles to ``[rows, S, 8, 32]`` sub-blocks in order."""
    rows, n_super = qs.shape[:2]
    return _nibbles(qs.reshape(rows, n_super, 4, 32)).reshape(rows, n_super, 8, 32)


def _q4_k(blk: np.ndarray) -> Unpacked:
    q = _k_codes4(blk[..., 16:144])
    scale, minimum = _k_group_scales(blk)
    return q.reshape(blk.shape[0], -1, 32), scale, minimum


def _q5_k(blk: np.ndarray) -> Unpacked:
    q = _k_codes4(blk[..., 48:176])
    q |= ((blk[..., None, 16:48] >> _SHIFTS_8[:, None]) & 1) << 4  # [rows, S, 8, 32]
    scale, minimum = _k_group_scales(blk)
    return q.reshape(blk.shape[0], -1, 32), scale, minimum


# Q6_K: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, f16 d;
# value = d * scale[i // 16] * (q - 32) for element i of the super-block. It is laid
# out as two 128-element halves, each using 64 bytes of ql and 32 of qh. Within a
# half, the low nibbles of its 64 ql bytes are elements 0-63 and the high nibbles
# 64-127; qh[l] carries the high bits of elements l, l+32, l+64, l+96 in its bit
# pairs 0-1, 2-3, 4-5, 6-7. Symmetric codes with signed 8-bit scales need no min.


def _q6_k(blk: np.ndarray) -> Unpacked:
    rows, n_super = blk.shape[:2]
    q = _nibbles(blk[..., 0:128].reshape(rows, n_super, 2, 64))  # [rows, S, 2, 128]
    qh = blk[..., 128:192].reshape(rows, n_super, 2, 1, 32)
    q |= (((qh >> _SHIFTS_2BIT[:, None]) & 3) << 4).reshape(rows, n_super, 2, 128)
    q = q.view(np.int8)
    q -= 32
    sub_scales = blk[..., 192:208].view(np.int8).astype(np.float32)
    scale = _f16_field(blk, 208)[..., None] * sub_scales
    return q.reshape(rows, n_super * 16, 16), scale.reshape(rows, n_super * 16)


# Q2_K: 16 bytes of sub-block scales (low nibble: scale, high nibble: min, both 4-bit),
# 64 bytes of 2-bit codes, then f16 d and dmin; 16 sub-blocks of 16 elements, value =
# d*sc*q - dmin*mn. The codes come as two 128-element halves of 32 bytes, each byte
# holding four codes: bits 2s..2s+1 of byte l of half h are element h*128 + s*32 + l.


def _k_codes2(qs: np.ndarray) -> np.ndarray:
    """``[rows, S, 64]`` bytes of 2-bit codes to ``[rows, S, 8, 32]`` in element order."""
    rows, n_super = qs.shape[:2]
    q = (qs.reshape(rows, n_super, 2, 1, 32) >> _SHIFTS_2BIT[:, None]) & 3
    return q.reshape(rows, n_super, 8, 32)


def _q2_k(blk: np.ndarray) -> Unpacked:
    rows, n_super = blk.shape[:2]
    sc = blk[..., 0:16]
    q = _k_codes2(blk[..., 16:80])
    scale = _f16_field(blk, 80)[..., None] * (sc & 0x0F).astype(np.float32)
    minimum = _f16_field(blk, 82)[..., None] * (sc >> 4).astype(np.float32)
    groups = n_super * 16
    return q.reshape(rows, groups, 16), scale.reshape(rows, groups), minimum.reshape(rows, groups)


# Q3_K: 32 bytes hmask, 64 bytes of 2-bit low codes (laid out as Q2_K's), 12 bytes of
# sixteen 6-bit scales, f16 d; value = d*(sc - 32)*q with q = low - 4 where the hmask
# bit is clear (bit b of hmask byte l belongs to element b*32 + l). Scale i takes its
# low 4 bits from byte i % 8 (low nibble for i < 8, high for i >= 8) and its top 2 bits
# from byte 8 + i % 4, bit pair i // 4.


def _q3_k(blk: np.ndarray) -> Unpacked:
    rows, n_super = blk.shape[:2]
    low = _k_codes2(blk[..., 32:96]).view(np.int8)
    high = ((blk[..., None, 0:32] >> _SHIFTS_8[:, None]) & 1) ^ 1  # [rows, S, 8, 32]
    q = low - (high << 2).view(np.int8)
    field = blk[..., 96:108]
    lo = (field[..., None, 0:8] >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F
    hi = (field[..., None, 8:12] >> _SHIFTS_2BIT[:, None]) & 3
    sc = (lo.reshape(rows, n_super, 16) | (hi.reshape(rows, n_super, 16) << 4)).view(np.int8)
    scale = _f16_field(blk, 108)[..., None] * (sc - np.int8(32)).astype(np.float32)
    return q.reshape(rows, n_super * 16, 16), scale.reshape(rows, n_super * 16)


# IQ4_NL and IQ4_XS: 4-bit indices into a fixed non-uniform table of 16 int8 values
# (nibbles laid out as Q4_0's). IQ4_NL: 32-element blocks of f16 d + 16 bytes; value =
# d * table[q]. IQ4_XS: 256-element super-blocks of f16 d, a u16 of the eight scales'
# top 2 bits (pair i for sub-block i), 4 bytes of their low nibbles (sub-block i in
# byte i // 2, low nibble first), then 8 x 16 bytes of indices; value = d*(sc - 32) *
# table[q] per 32-element sub-block.
_IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                       113], dtype=np.int8)


def _iq4_nl(blk: np.ndarray) -> Unpacked:
    return _IQ4_TABLE[_nibbles(blk[..., 2:])], _f16_field(blk, 0)


def _iq4_xs(blk: np.ndarray) -> Unpacked:
    rows, n_super = blk.shape[:2]
    q = _IQ4_TABLE[_nibbles(blk[..., 8:136].reshape(rows, n_super, 8, 16))]
    lo = (blk[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F  # [rows, S, 4, 2]
    top = blk[..., 2].astype(np.uint16) | (blk[..., 3].astype(np.uint16) << 8)
    hi = ((top[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    sc = (lo.reshape(rows, n_super, 8) | (hi << 4)).view(np.int8)
    scale = _f16_field(blk, 0)[..., None] * (sc - np.int8(32)).astype(np.float32)
    return q.reshape(rows, n_super * 8, 32), scale.reshape(rows, n_super * 8)


# MXFP4 (gpt-oss's experts): 32-element blocks of one E8M0 exponent byte e and 16
# bytes of 4-bit E2M1 codes (nibbles as Q4_0's). The table holds twice the E2M1
# values, so the scale is half of 2^(e - 127): for e >= 2 the float with exponent
# field e - 1, below that the subnormal 2^(e - 128) (0x00200000 << e).
_MXFP4_TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                        dtype=np.int8)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _mxfp4(blk: np.ndarray) -> Unpacked:
    return _MXFP4_TABLE[_nibbles(blk[..., 1:])], _e8m0_half(blk[..., 0])


# ------------------------------------------------------------------ public unpackers

# Per format: the unpacker and whether its offset is subtracted (K-quant minimums)
# rather than added (the "_1" formats' m).
_FORMATS: dict[GGMLType, tuple[Callable[[np.ndarray], Unpacked], bool]] = {
    GGMLType.Q8_0: (_q8_0, False),
    GGMLType.Q4_0: (_q4_0, False),
    GGMLType.Q4_1: (_q4_1, False),
    GGMLType.Q5_0: (_q5_0, False),
    GGMLType.Q5_1: (_q5_1, False),
    GGMLType.Q2_K: (_q2_k, True),
    GGMLType.Q3_K: (_q3_k, False),
    GGMLType.Q4_K: (_q4_k, True),
    GGMLType.Q5_K: (_q5_k, True),
    GGMLType.Q6_K: (_q6_k, False),
    GGMLType.IQ4_NL: (_iq4_nl, False),
    GGMLType.IQ4_XS: (_iq4_xs, False),
    GGMLType.MXFP4: (_mxfp4, False),
}


def _unpack(raw: RawBytes, ggml_type: GGMLType, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Run a format's unpacker and hand the parts over as torch tensors.

    Parts that still alias the input (Q8_0's codes) are copied, so the caller never
    holds a writable tensor over a read-only file mapping.
    """
    blk = block_view(raw, ggml_type, tuple(shape))
    parts = _FORMATS[ggml_type][0](blk)
    return tuple(
        torch.from_numpy(p.copy() if np.may_share_memory(p, blk) else np.ascontiguousarray(p))
        for p in parts
    )


def unpack_affine(raw: RawBytes, ggml_type: int, shape: tuple[int, ...]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A block type as ``value = codes * scale + offset``: codes ``[rows, groups,
    group]`` (group 16 or 32), f32 ``scale`` and ``offset`` (None: 0) ``[rows, groups]``.
    A subtracted minimum comes back negated (exact), so dequantize's roundings hold."""
    gt = GGMLType(ggml_type)
    unpack, subtract = _FORMATS[gt]
    q, scale, *offset = unpack(block_view(raw, gt, tuple(shape)))
    if not offset:
        return q, scale, None
    return q, scale, -offset[0] if subtract else offset[0]


def q8_0_unpack(raw: RawBytes, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 codes ``q`` int8 ``[rows, n/32, 32]`` and scales ``d`` f32 ``[rows, n/32]``."""
    return _unpack(raw, GGMLType.Q8_0, shape)  # type: ignore[return-value]


def q4_0_unpack(raw: RawBytes, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 codes ``q`` int8 in [-8, 7] (already centred) ``[rows, n/32, 32]`` and ``d``."""
    return _unpack(raw, GGMLType.Q4_0, shape)  # type: ignore[return-value]


def q4_1_unpack(
    raw: RawBytes, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 nibbles ``q`` uint8 ``[rows, n/32, 32]`` in element order, ``d``, ``m``.

    value = q * d + m, with ``d`` and ``m`` f32 ``[rows, n/32]``.
    """
    return _unpack(raw, GGMLType.Q4_1, shape)  # type: ignore[return-value]


def q5_0_unpack(raw: RawBytes, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 codes ``q`` int8 in [-16, 15] ``[rows, n/32, 32]`` and ``d``."""
    return _unpack(raw, GGMLType.Q5_0, shape)  # type: ignore[return-value]


def q5_1_unpack(
    raw: RawBytes, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_1 codes ``q`` uint8 in [0, 31] ``[rows, n/32, 32]``, ``d``, ``m``."""
    return _unpack(raw, GGMLType.Q5_1, shape)  # type: ignore[return-value]


def q4_k_unpack(
    raw: RawBytes, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K codes ``q`` uint8 in [0, 15] ``[rows, n/32, 32]``, ``scale``, ``minimum``.

    value = q * scale - minimum (subtracted, unlike Q4_1's m); both f32 ``[rows, n/32]``.
    """
    return _unpack(raw, GGMLType.Q4_K, shape)  # type: ignore[return-value]


def q5_k_unpack(
    raw: RawBytes, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K: like ``q4_k_unpack`` with codes in [0, 31]."""
    return _unpack(raw, GGMLType.Q5_K, shape)  # type: ignore[return-value]


def q6_k_unpack(raw: RawBytes, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K codes ``q`` int8 in [-32, 31] ``[rows, n/16, 16]`` and ``scale`` ``[rows, n/16]``."""
    return _unpack(raw, GGMLType.Q6_K, shape)  # type: ignore[return-value]


# -------------------------------------------------------------------------- dequantize


def _affine(
    q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, subtract: bool
) -> np.ndarray:
    """``q * scale (+/- offset)`` in f32, one rounding per operation (like the reference)."""
    out = q.astype(np.float32)
    out *= scale[..., None]
    if offset is not None:
        if subtract:
            out -= offset[..., None]
        else:
            out += offset[..., None]
    return out


def _plain_float(
    raw: RawBytes, ggml_type: GGMLType, shape: tuple[int, ...], name: str | None
) -> np.ndarray:
    u8 = block_view(raw, ggml_type, shape, name).reshape(-1)
    if ggml_type == GGMLType.F32:
        return u8.view(np.float32).copy()  # never alias the caller's (mmap) buffer
    if ggml_type == GGMLType.F16:
        return u8.view(np.float16).astype(np.float32)
    # bf16 is the top half of an f32, so widening is a 16-bit shift.
    return (u8.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequantize(
    raw: RawBytes, ggml_type: int, shape: tuple[int, ...], *, name: str | None = None
) -> torch.Tensor:
    """Decode ``raw`` (a tensor's bytes) of ``ggml_type`` into a float32 tensor of ``shape``.

    ``shape`` is in torch order (GGUF ``ne`` reversed). Raises UnsupportedModelError
    for a type outside SUPPORTED_TYPES and GGUFError if the byte count does not
    match the shape. ``name`` only improves error messages. The result owns its
    memory (it never aliases ``raw``).
    """
    shape = tuple(int(d) for d in shape)
    if ggml_type not in SUPPORTED_TYPES:
        what = f"tensor {name!r}: " if name else ""
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise UnsupportedModelError(
            f"{what}tensor type {_type_name(ggml_type)} is not supported (supported: {supported})"
        )
    gt = GGMLType(ggml_type)
    if 0 in shape:  # nothing to decode (the block arithmetic has no rows to shape)
        if _as_u8(raw).size:
            raise GGUFError(f"tensor {name!r}: shape {shape} holds nothing, its data "
                            f"has {_as_u8(raw).size} bytes")
        return torch.zeros(shape)
    if gt in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        out = _plain_float(raw, gt, shape, name)
    else:
        unpack, subtract = _FORMATS[gt]
        q, scale, *offset = unpack(block_view(raw, gt, shape, name))
        out = _affine(q, scale, offset[0] if offset else None, subtract)
    return torch.from_numpy(out.reshape(shape))
