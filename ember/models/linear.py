"""The weight seam: how a linear layer's weights are stored and multiplied.

Model code only ever calls ``layer(x)`` on a :class:`Linear`; which bytes back it
(float32 dequantized from GGUF, bfloat16, or packed int8/int4 later) is decided
here by a :class:`WeightFormat`, so a faster representation never touches the
model files. Several GGUF tensors can be fused into one layer (QKV, gate/up),
concatenated along the output dimension, so each step does one matmul for them.

Formats: ``f32`` (the oracle), ``bf16``, and ``q4``, which keeps GGUF's block
quantization (Q4_0/Q4_1 as 4-bit codes and Q8_0/Q5_0 as 8-bit codes with per-32 f16
scales; K-quants, and block types fused with them, as "k8": 8-bit codes with f32
scales per 16 and offsets per 32) and multiplies with the native kernels in
:mod:`ember.kernels`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ember.errors import UnsupportedModelError
from ember.models.gguf import BLOCK_GEOMETRY, GGMLType, GGUFFile
from ember.models.quant import dequantize, q5_0_unpack, unpack_affine


class Linear(Protocol):
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for x of shape (..., in_features), returned in float32."""
        ...


class DenseLinear:
    """Weights held as a dense (out, in) tensor; float32 is the correctness oracle."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).float()


class Embedding(Protocol):
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows for ``tokens`` (T,) as float32 (T, hidden)."""
        ...

    def tied_linear(self) -> Linear | None:
        """The same weights as an output head, sharing storage; None if not possible."""
        ...


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens].float()

    def tied_linear(self) -> Linear:
        return DenseLinear(self.weight)


class MappedEmbedding:
    """Rows dequantized on demand straight from the GGUF file mapping.

    Used with quantized formats so the embedding table is never resident twice: the
    tied output head keeps the packed copy, lookups read the few rows a step needs.
    """

    def __init__(self, gguf: GGUFFile, name: str) -> None:
        info = gguf.tensor(name)
        self.rows, self.cols = info.shape
        self.ggml_type = info.ggml_type
        self._raw = gguf.tensor_bytes(name).reshape(self.rows, -1)
        self.name = name

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self._raw[tokens.numpy()]
        return dequantize(rows, self.ggml_type, (len(rows), self.cols), name=self.name)

    def tied_linear(self) -> None:
        return None


class WeightFormat(Protocol):
    """How weights are stored and multiplied, and the norm kernel that goes with them."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear: ...

    def linear_from_raw(self, parts: Sequence[RawPart], names: Sequence[str]) -> Linear:
        """The same, from raw GGUF bytes already in hand (e.g. an expert read from disk)."""
        ...

    def embedding(self, gguf: GGUFFile, name: str) -> Embedding: ...


class DenseFormat:
    """Dequantize every weight to a dense tensor of ``dtype``."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear:
        parts = [load_dense(gguf, n).to(self.dtype) for n in names]
        return DenseLinear(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))

    def linear_from_raw(self, parts: Sequence[RawPart], names: Sequence[str]) -> Linear:
        dense = [dequantize(raw, t, shape, name=n).to(self.dtype)
                 for (raw, t, shape), n in zip(parts, names, strict=True)]
        return DenseLinear(dense[0] if len(dense) == 1 else torch.cat(dense, dim=0))

    def embedding(self, gguf: GGUFFile, name: str) -> Embedding:
        return DenseEmbedding(load_dense(gguf, name).to(self.dtype))


# ---------------------------------------------------------------- quantized weights
#
# GGUF blocks are split once at load into codes and f16 scale arrays, which the
# kernel then interleaves into 8-row groups (layouts in ember/kernels/
# quant_matmul.cpp); bytes are only moved, never re-rounded, so the weights are
# exactly GGUF's. Q4_0 ((q - 8) * d) becomes the
# Q4_1 form q * d + m with m = -8 d: multiplying an f16 by 8 is exact unless it
# overflows, which is checked. Rows of several tensors of one layout concatenate
# along the output dim losslessly, so fused QKV / gate-up stay one kernel call.

# Activation-row count from which QuantLinear dequantizes weight chunks to f32 and
# uses a BLAS GEMM (f32-exact) instead of the int8-activation kernels; None: never.
# The fused native stack (ember/kernels/fused_decoder.h) never switches: a kernel
# choice that follows the batch's size would make q4 batch-dependent.
# The integer kernels were faster at every M measured (1.4-2x f32 GEMM at M=300-512
# on 2 AVX-512-VNNI cores), so prefill uses them too, with the same ~0.5% error as
# decode. Set a number to trade prefill speed for f32-exact prompt activations.
GEMM_MIN_M: int | None = None
_NEVER = 1 << 62

_Q4_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1)
# Q5_0's codes (q - 16, in [-16, 15]) and f16 d are an 8-bit block as they stand
_Q8_TYPES = (GGMLType.Q8_0, GGMLType.Q5_0)
# K-quants need f32 scales per 16 and offsets (k8); any block type fits k8 exactly, so
# a layer fusing a K-quant with other block types (QKV of a Q4_K_M file) is k8 whole.
_K8_TYPES = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
_BLOCK_TYPES = (*_Q4_TYPES, *_Q8_TYPES, *_K8_TYPES, GGMLType.Q5_1)


RawPart = tuple[np.ndarray, int, tuple[int, ...]]  # (raw bytes, ggml type, torch shape)


def _raw_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...],
                name: str) -> np.ndarray:
    """A 2-D quantized tensor's bytes as ``[rows, blocks_per_row, bytes_per_block]``."""
    gt = GGMLType(ggml_type)
    block_elems, block_bytes = BLOCK_GEOMETRY[gt]
    if len(shape) != 2 or shape[1] % block_elems:
        raise UnsupportedModelError(f"tensor {name!r}: shape {shape} is not a "
                                    f"[rows, k*{block_elems}] {gt.name} matrix")
    rows, cols = shape
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != rows * cols // block_elems * block_bytes:
        raise UnsupportedModelError(f"tensor {name!r}: {raw.size} bytes do not match {gt.name} "
                                    f"shape {shape}")
    return raw.reshape(rows, cols // block_elems, block_bytes)


def _f16(blk: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blk[..., start:start + 2]).view(np.float16)[..., 0]


def pack_q4(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...],
            name: str = "?") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1 bytes -> (codes uint8 [rows, K/2], d f16 [rows, K/32], m f16 [rows, K/32]).

    Codes stay in GGUF's per-block order (byte j: element j low nibble, j+16 high).
    """
    blk = _raw_blocks(raw, ggml_type, shape, name)
    rows = blk.shape[0]
    if ggml_type == GGMLType.Q4_1:  # d, m, 16 bytes of nibbles
        return blk[..., 4:].reshape(rows, -1), _f16(blk, 0), _f16(blk, 2)
    if ggml_type != GGMLType.Q4_0:
        raise UnsupportedModelError(f"tensor {name!r}: {GGMLType(ggml_type).name} is not 4-bit")
    d = _f16(blk, 0)  # Q4_0: d, 16 bytes of nibbles; (q - 8) d == q d + (-8 d)
    with np.errstate(over="ignore"):
        m = d * np.float16(-8)
    if not np.isfinite(m[np.isfinite(d)]).all():
        raise UnsupportedModelError(f"tensor {name!r}: Q4_0 scale too large for the q4 layout")
    return blk[..., 2:].reshape(rows, -1), d, m


def pack_q8(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...],
            name: str = "?") -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 or Q5_0 bytes -> (codes int8 [rows, K], d f16 [rows, K/32]); w = code * d.

    Q5_0 (w = (q - 16) d, q 5-bit) becomes centred int8 codes with its own d: exact,
    at 1.0625 bytes per weight instead of the file's 0.6875 (still a quarter of f32).
    """
    if ggml_type not in _Q8_TYPES:
        raise UnsupportedModelError(f"tensor {name!r}: {GGMLType(ggml_type).name} is not an "
                                    "8-bit-packable type (Q8_0, Q5_0)")
    blk = _raw_blocks(raw, ggml_type, shape, name)
    if ggml_type == GGMLType.Q5_0:
        codes, _ = q5_0_unpack(blk.reshape(-1), shape)
        return codes.numpy().reshape(blk.shape[0], -1), _f16(blk, 0)
    return blk[..., 2:].reshape(blk.shape[0], -1).view(np.int8), _f16(blk, 0)


def pack_k8(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], name: str = "?"
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Any block type -> (codes int8 [rows, K], scales f32 [rows, K/16], offsets f32
    [rows, K/32] or None), with value = code * scale + offset exactly as dequantize."""
    if ggml_type not in _BLOCK_TYPES:
        raise UnsupportedModelError(f"tensor {name!r}: {GGMLType(ggml_type).name} is not a "
                                    "block type k8 can hold")
    _raw_blocks(raw, ggml_type, shape, name)  # shape and size checks
    codes, scale, offset = unpack_affine(raw, ggml_type, shape)
    rows = shape[0]
    per16 = np.repeat(scale, 2, axis=1) if codes.shape[-1] == 32 else scale
    return (np.ascontiguousarray(codes.reshape(rows, -1)).view(np.int8),
            np.ascontiguousarray(per16, dtype=np.float32),
            None if offset is None else np.ascontiguousarray(offset, dtype=np.float32))


def _cat(parts: Sequence[np.ndarray]) -> torch.Tensor:
    """Row-concatenate into a tensor that owns its memory (never the file mapping).

    A single part that is already a contiguous array of its own (the packers copy
    out of the mapping) is taken as it is: at load the output head is the largest
    transient, and one copy fewer of it lowers the peak RSS.
    """
    if len(parts) == 1 and parts[0].flags.c_contiguous and _owns_its_memory(parts[0]):
        return torch.from_numpy(parts[0])
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=0)))


def _owns_its_memory(a: np.ndarray) -> bool:
    """Whether ``a``'s memory is a numpy allocation (not a file mapping or buffer)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base is None and a.flags.owndata


class QuantLinear:
    """Weights in GGUF block quantization, multiplied by a native kernel.

    ``bits`` 4 (from Q4_0/Q4_1): 4-bit codes + f16 scale ``d`` and offset ``m`` per
    32 weights, 0.625 B/weight; ``bits`` 8 (from Q8_0 or Q5_0): int8 codes + f16 ``d``,
    1.0625 B/weight; ``bits`` 16, "k8" (K-quants, and block types fused with them):
    int8 codes + f32 scales per 16 weights + f32 offsets per 32 where the type has
    them, 1.25-1.375 B/weight. Built from GGUF-order codes and scales, which the kernel repacks into
    8-row interleaved groups (``ember/kernels/quant_matmul.cpp`` has the layout).

    Activations are quantized per 32 to int8 and dotted in integers (llama.cpp's
    scheme; ~0.5% relative error against the f32 oracle), unless there are at least
    ``gemm_min_m`` rows (default ``GEMM_MIN_M``; None: never): then weight chunks are
    dequantized to f32 and multiplied by BLAS (f32-exact up to summation order).
    """

    def __init__(self, bits: int, codes: torch.Tensor, d: torch.Tensor,
                 m: torch.Tensor | None = None) -> None:
        from ember import kernels

        ext = kernels.quant_matmul()
        if ext is None:
            raise UnsupportedModelError(
                "weight format 'q4' needs ember's native quantized-matmul kernel, which is "
                f"unavailable here ({kernels.unavailable_reason()}); use --weights f32")
        self.bits = bits
        self.out_features = n = codes.shape[0]
        self.in_features = d.shape[1] * 32
        if bits == 4:
            self.packed: tuple[torch.Tensor, ...] = tuple(ext.q4_pack(codes, d, m))
            self._kernel = ext.q4_matmul
            self._dequant = ext.q4_dequantize
        elif bits == 16:
            self.in_features = codes.shape[1]
            empty = torch.empty(0, dtype=torch.float32)
            self.packed = tuple(ext.k8_pack(codes, d, m if m is not None else empty))
            self._kernel = ext.k8_matmul
            self._dequant = ext.k8_dequantize
        else:
            self.packed = tuple(ext.q8_pack(codes, d))
            self._kernel = ext.q8_matmul
            self._dequant = ext.q8_dequantize
        self._args = (*self.packed, n)
        self.gemm_min_m = GEMM_MIN_M

    @property
    def gemm_min_m(self) -> int | None:
        return self._gemm_min_m

    @gemm_min_m.setter
    def gemm_min_m(self, value: int | None) -> None:
        self._gemm_min_m = value
        self._gm = _NEVER if value is None else value

    @classmethod
    def from_raw(cls, parts: Sequence[RawPart], names: Sequence[str] | None = None) -> QuantLinear:
        """One layer from GGUF tensors of block types, row-fused: 4-bit if all are
        Q4_0/Q4_1, 8-bit if all are Q8_0/Q5_0, else k8."""
        names = names or ["?"] * len(parts)
        if all(p[1] in _Q4_TYPES for p in parts):
            packed = [pack_q4(*p, name=n) for p, n in zip(parts, names, strict=True)]
            return cls(4, *(_cat(list(a)) for a in zip(*packed, strict=True)))
        if all(p[1] in _Q8_TYPES for p in parts):
            packed8 = [pack_q8(*p, name=n) for p, n in zip(parts, names, strict=True)]
            return cls(8, *(_cat(list(a)) for a in zip(*packed8, strict=True)))
        if all(p[1] in _BLOCK_TYPES for p in parts):
            k8 = [pack_k8(*p, name=n) for p, n in zip(parts, names, strict=True)]
            codes, scales = _cat([c for c, _, _ in k8]), _cat([s for _, s, _ in k8])
            mins = None
            if any(m is not None for _, _, m in k8):  # a part without offsets: zeros
                mins = _cat([m if m is not None else np.zeros((c.shape[0], c.shape[1] // 32),
                                                              np.float32)
                             for c, _, m in k8])
            return cls(16, codes, scales, mins)
        raise UnsupportedModelError(f"tensors {list(names)}: no single quantized layout for types "
                                    f"{[GGMLType(p[1]).name for p in parts]}")

    @property
    def nbytes(self) -> int:
        """Bytes held for the weight (rows padded to a multiple of 8)."""
        return sum(t.nbytes for t in self.packed)

    def packed_form(self) -> tuple[int, int, list[torch.Tensor]]:
        """(bits, rows, packed tensors): how the native decoder stack takes this layer."""
        return self.bits, self.out_features, list(self.packed)

    def dequantize(self) -> torch.Tensor:
        """The weight as dense f32 ``[out, in]`` (equal to quant.dequantize of the source)."""
        return self._dequant(*self._args, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Lean on purpose: ~120 calls per decode step. The kernel makes x contiguous.
        if x.dtype != torch.float32:
            x = x.float()
        if x.dim() == 2:
            return self._kernel(x, *self._args, self._gm)
        y = self._kernel(x.reshape(-1, self.in_features), *self._args, self._gm)
        return y.view(*x.shape[:-1], self.out_features)


class ConcatLinear:
    """Several linears over one input, outputs concatenated (fused parts of mixed formats)."""

    def __init__(self, parts: Sequence[Linear]) -> None:
        self.parts = list(parts)
        self.in_features = self.parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class QuantFormat:
    """Keep Q4_0/Q4_1 weights 4-bit, Q8_0/Q5_0 8-bit and K-quants (Q4_K, Q5_K, Q6_K) as k8;
    other types (F32/F16/BF16, Q2_K, Q3_K) dense f32."""

    name = "q4"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The native one-call RMSNorm (the kernel is loaded by then: the linears need it)."""
        from ember import kernels

        return kernels.quant_matmul().rms_norm(x, weight, eps)

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear:
        parts = [(gguf.tensor_bytes(n), gguf.tensor(n).ggml_type, gguf.tensor(n).shape)
                 for n in names]
        return self.linear_from_raw(parts, names)

    def linear_from_raw(self, parts: Sequence[RawPart], names: Sequence[str]) -> Linear:
        def layout(gt: int) -> str:
            return ("q4" if gt in _Q4_TYPES else "q8" if gt in _Q8_TYPES
                    else "k8" if gt in _BLOCK_TYPES else "f32")

        kinds = [layout(p[1]) for p in parts]
        if "f32" not in kinds and len(set(kinds)) > 1:
            kinds = ["k8"] * len(kinds)  # one fused layer: k8 holds every block type
        layers: list[Linear] = []
        items = zip(parts, names, kinds, strict=True)
        for kind, group in groupby(items, key=lambda item: item[2]):
            group = [(part, name) for part, name, _ in group]
            raw_parts, group_names = zip(*group, strict=True)
            if kind == "f32":
                layers.append(DENSE_F32.linear_from_raw(raw_parts, group_names))
            else:
                layers.append(QuantLinear.from_raw(raw_parts, group_names))
        return layers[0] if len(layers) == 1 else ConcatLinear(layers)

    def embedding(self, gguf: GGUFFile, name: str) -> Embedding:
        if gguf.tensor(name).ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            return DENSE_F32.embedding(gguf, name)
        return MappedEmbedding(gguf, name)


DENSE_F32 = DenseFormat(torch.float32)


def linear_nbytes(layer: Linear) -> int:
    """Bytes of weight a Linear holds (and reads once per forward)."""
    if isinstance(layer, ConcatLinear):
        return sum(linear_nbytes(p) for p in layer.parts)
    if isinstance(layer, QuantLinear):
        return layer.nbytes
    if isinstance(layer, DenseLinear):
        return layer.weight.nbytes
    raise TypeError(f"unknown Linear type {type(layer).__name__}")

WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "f32": DENSE_F32,
    "bf16": DenseFormat(torch.bfloat16),
    "q4": QuantFormat(),
}
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)


def resolve_weights(name: str) -> str:
    """``auto``: the fastest format the tests prove equivalent — ``q4`` where the native
    kernel builds (teacher-forced top-1 agreement with f32 ~96 %, mean KL ~3e-3 on
    SmolLM2; see docs/performance.md), else the ``f32`` oracle."""
    if name != "auto":
        return name
    from ember import kernels

    return "q4" if kernels.available() else "f32"


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[resolve_weights(name)]
    except KeyError:
        raise ValueError(
            f"unknown weight format {name!r} (choose from {', '.join(WEIGHT_CHOICES)})"
        ) from None


def load_dense(gguf: GGUFFile, name: str) -> torch.Tensor:
    """A GGUF tensor dequantized to float32 in PyTorch shape order."""
    info = gguf.tensor(name)
    return dequantize(gguf.tensor_bytes(name), info.ggml_type, info.shape, name=name)
