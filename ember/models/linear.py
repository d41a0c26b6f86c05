"""The weight seam: how a linear layer's weights are stored and multiplied.

Model code only ever calls ``layer(x)`` on a :class:`Linear`; which bytes back it
(float32 dequantized from GGUF, bfloat16, or GGUF's own quantized blocks) is decided
here by a :class:`WeightFormat`, so a faster representation never touches the model
files. Several GGUF tensors can be fused into one layer (QKV, gate/up), concatenated
along the output dimension, so each step does one matmul for them.

Formats: ``f32`` (the oracle), ``bf16``, and ``q4``, which keeps every GGUF block type
that has a packed layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) at its own
bit width, rearranged 16 rows at a time for the integer kernels in
:mod:`ember.kernels` (``ember/kernels/quant_layouts.h`` has the layouts), and any other
tensor type dense f32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import groupby
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ember import kernels
from ember.errors import GGUFError, UnsupportedModelError
from ember.models.gguf import GGMLType, GGUFFile, TensorInfo
from ember.models.quant import block_view, dequantize


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
    """How weights are stored and multiplied: the layers a GGUF's matrices load as."""

    name: str

    def bind(self, gguf: GGUFFile) -> WeightFormat:
        """The format that loads ``gguf``'s weights (it may hold memory for them)."""
        ...

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear: ...

    def linear_from_raw(self, parts: Sequence[RawPart], names: Sequence[str],
                        alloc: Callable[[int], torch.Tensor] | None = None) -> Linear:
        """The same, from raw GGUF bytes already in hand (e.g. an expert read from disk);
        ``alloc(nbytes)``: where packed bytes go (a :class:`WeightArena`; default: tensors
        of their own, for weights that come and go)."""
        ...

    def embedding(self, gguf: GGUFFile, name: str, tied: bool = False) -> Embedding:
        """The token embedding ``name``; ``tied``: it is also the output head."""
        ...


class DenseFormat:
    """Dequantize every weight to a dense tensor of ``dtype``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]

    def bind(self, gguf: GGUFFile) -> DenseFormat:
        return self

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear:
        parts = [load_dense(gguf, n).to(self.dtype) for n in names]
        if len({p.shape[1:] for p in parts}) > 1:
            raise GGUFError(f"{gguf.path.name}: {', '.join(names)} are fused into one "
                            f"projection but have different input sizes "
                            f"({', '.join(str(tuple(p.shape)) for p in parts)})")
        return DenseLinear(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))

    def linear_from_raw(self, parts: Sequence[RawPart], names: Sequence[str],
                        alloc: Callable[[int], torch.Tensor] | None = None) -> Linear:
        dense = [dequantize(raw, t, shape, name=n).to(self.dtype)
                 for (raw, t, shape), n in zip(parts, names, strict=True)]
        return DenseLinear(dense[0] if len(dense) == 1 else torch.cat(dense, dim=0))

    def embedding(self, gguf: GGUFFile, name: str, tied: bool = False) -> Embedding:
        return DenseEmbedding(load_dense(gguf, name).to(self.dtype))


# ---------------------------------------------------------------- quantized weights
#
# GGUF's blocks are packed once at load, by the native kernel, straight from the file
# mapping into their layout (bits moved, never values re-rounded), a few MB of rows at
# a time, each chunk's file pages released once packed: loading never holds a float
# copy, nor the file and its packed copy at once.

# Activation-row count from which QuantLinear dequantizes weight chunks to f32 and
# uses a BLAS GEMM (f32-exact) instead of the int8-activation kernels; None: never.
# The fused native stack (ember/kernels/fused_decoder.h) never switches: a kernel
# choice that follows the batch's size would make q4 batch-dependent.
# The integer kernels were faster at every M measured (1.4-2x f32 GEMM at M=300-512
# on 2 AVX-512-VNNI cores), so prefill uses them too, with the same ~0.5% error as
# decode. Set a number to trade prefill speed for f32-exact prompt activations.
GEMM_MIN_M: int | None = None
_NEVER = 1 << 62

# Block types with a packed layout (ember/kernels/quant_layouts.h).
PACKED_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
                GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL,
                GGMLType.IQ4_XS, GGMLType.MXFP4)
PACK_CHUNK_BYTES = 8 << 20  # GGUF bytes packed per call (then their pages are released)

RawPart = tuple[np.ndarray, int, tuple[int, ...]]  # (raw bytes, ggml type, torch shape)


def _raw_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...],
                name: str) -> np.ndarray:
    """A 2-D quantized tensor's bytes as one flat uint8 array, its size checked."""
    gt = GGMLType(ggml_type)
    if len(shape) != 2:
        raise UnsupportedModelError(f"tensor {name!r}: shape {shape} is not a {gt.name} "
                                    "matrix")
    return block_view(raw, gt, shape, name).reshape(-1)


def _kernels():  # noqa: ANN202 - the compiled extension module
    ext = kernels.quant_matmul()
    if ext is None:
        raise UnsupportedModelError(
            "weight format 'q4' needs ember's native quantized-matmul kernel, which is "
            f"unavailable here ({kernels.unavailable_reason()}); use --weights f32")
    return ext


class QuantLinear:
    """Weights in GGUF block quantization at their own bit width, multiplied natively.

    One or more GGUF matrices (row-fused parts, possibly of different block types: the
    QKV of a Q4_K_M file is Q4_K, Q4_K and Q6_K) each packed 16 rows at a time into the
    layout of its type (``ember/kernels/quant_layouts.h``), holding exactly the GGUF's
    bytes. Activations are quantized per 32 to int8 and dotted in integers (llama.cpp's
    scheme; ~0.5% relative error against the f32 oracle), unless there are at least
    ``gemm_min_m`` rows (default ``GEMM_MIN_M``; None: never): then weight chunks are
    dequantized to f32 and multiplied by BLAS (f32-exact up to summation order).
    """

    def __init__(self, packed: object) -> None:
        self.packed = packed  # the extension's PackedLinear: the stack takes it as it is
        self.out_features: int = packed.out_features  # type: ignore[attr-defined]
        self.in_features: int = packed.in_features  # type: ignore[attr-defined]
        self._matmul = packed.matmul  # type: ignore[attr-defined]
        self.gemm_min_m = GEMM_MIN_M

    @property
    def gemm_min_m(self) -> int | None:
        return self._gemm_min_m

    @gemm_min_m.setter
    def gemm_min_m(self, value: int | None) -> None:
        self._gemm_min_m = value
        self._gm = _NEVER if value is None else value

    @classmethod
    def from_raw(cls, parts: Sequence[RawPart], names: Sequence[str] | None = None,
                 on_packed: Callable[[np.ndarray], None] | None = None,
                 alloc: Callable[[int], torch.Tensor] | None = None) -> QuantLinear:
        """One layer from GGUF matrices of packable block types, row-fused in order.

        ``on_packed(chunk)`` is called with each stretch of raw bytes once it is packed
        (the loader releases the file pages behind it); ``alloc(nbytes)`` gives the
        uint8 tensors the packed bytes go to (default: ``torch.empty``)."""
        names = names or ["?"] * len(parts)
        ext = _kernels()
        in_features = None
        segments = []
        for (raw, ggml_type, shape), name in zip(parts, names, strict=True):
            if ggml_type not in PACKED_TYPES:
                raise UnsupportedModelError(f"tensor {name!r}: {_type_name(ggml_type)} has no "
                                            "packed layout")
            flat = _raw_blocks(raw, ggml_type, shape, name)
            rows, cols = shape
            if in_features not in (None, cols):
                raise UnsupportedModelError(f"tensor {name!r}: {cols} columns, the layer's "
                                            f"other parts have {in_features}")
            in_features = cols
            nbytes = ext.packed_nbytes(int(ggml_type), rows, cols)
            blob = alloc(nbytes) if alloc else torch.empty(nbytes, dtype=torch.uint8)
            row_bytes = flat.size // rows
            step = max(16, PACK_CHUNK_BYTES // row_bytes // 16 * 16)
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                chunk = flat[r0 * row_bytes:(r0 + n) * row_bytes]
                ext.pack_rows(blob, chunk, int(ggml_type), r0, n, cols)
                if on_packed is not None:
                    on_packed(chunk)
            segments.append((int(ggml_type), rows, blob))
        return cls(ext.PackedLinear(in_features, segments))

    @property
    def types(self) -> list[GGMLType]:
        """The block type of each row-fused part, in order."""
        return [GGMLType(t) for t in self.packed.types]  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        """Bytes held for the weight (the GGUF's, plus at most 63 per 16 rows)."""
        return self.packed.nbytes  # type: ignore[attr-defined]

    def dequantize(self) -> torch.Tensor:
        """The weight as dense f32 ``[out, in]`` (equal to quant.dequantize of the source)."""
        return self.packed.dequantize()  # type: ignore[attr-defined]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight as f32 ``[len(ids), in]`` (bit-exact, like dequantize)."""
        return self.packed.dequantize_rows(ids)  # type: ignore[attr-defined]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Lean on purpose: called per layer and per expert. The kernel makes x contiguous.
        if x.dtype != torch.float32:
            x = x.float()
        if x.dim() == 2:
            return self._matmul(x, self._gm)
        y = self._matmul(x.reshape(-1, self.in_features), self._gm)
        return y.view(*x.shape[:-1], self.out_features)


class PackedEmbedding:
    """Token rows read from a packed tied output head: the table is resident once, and
    the file is never read again for it (rows are dequantized exactly, as from the file)."""

    def __init__(self, head: QuantLinear) -> None:
        self.head = head

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.rows(tokens)

    def tied_linear(self) -> QuantLinear:
        return self.head


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"type#{ggml_type}"


class ConcatLinear:
    """Several linears over one input, outputs concatenated (fused parts of mixed formats)."""

    def __init__(self, parts: Sequence[Linear]) -> None:
        self.parts = list(parts)
        self.in_features = self.parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class WeightArena:
    """Memory for one model's packed weights, in transparent huge pages where the OS
    gives them: a decode step streams every weight, and with 4 KB pages it takes a TLB
    miss (in a VM, a nested page walk) every 4 KB; with 2 MB pages every 2 MB. Measured
    on a 2-core Zen 5 VM: one core streams Q4_K/Q4_0/Q8_0 weights 1.2-1.4x faster
    (17.8 -> 21.9, 17.2 -> 25.4, 26.0 -> 34.3 GB/s).

    Blobs are carved in order from one reservation of ``capacity`` bytes (virtual: a
    page counts in the resident set once written), so they lie back to back and a
    thread's weights are one stream. Blobs that no longer fit come from ``torch.empty``.
    """

    ALIGN = 64

    def __init__(self, capacity: int) -> None:
        self._buf = _kernels().huge_empty(capacity)
        self._used = 0

    @classmethod
    def for_tensors(cls, tensors: Iterable[TensorInfo]) -> WeightArena:
        """Room for every packable matrix (or stack of experts' matrices, [E, out, in])
        among ``tensors``: their bytes, plus at most 63 per 16 rows and 63 per matrix
        that packing and alignment add."""
        total = 0
        for t in tensors:
            if t.ggml_type in PACKED_TYPES and len(t.shape) in (2, 3):
                count = t.shape[0] if len(t.shape) == 3 else 1
                total += t.nbytes + count * (-(-t.shape[-2] // 16) + 1) * cls.ALIGN
        return cls(total)

    def __call__(self, nbytes: int) -> torch.Tensor:
        at = -(-self._used // self.ALIGN) * self.ALIGN
        if at + nbytes > self._buf.numel():
            return torch.empty(nbytes, dtype=torch.uint8)
        self._used = at + nbytes
        return self._buf[at:at + nbytes]


class QuantFormat:
    """Keep every block type with a packed layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K,
    Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4) at its own bit width; other types
    (F32/F16/BF16, Q2_K) dense f32."""

    name = "q4"

    def __init__(self, arena: WeightArena | None = None) -> None:
        self._arena = arena

    def bind(self, gguf: GGUFFile) -> QuantFormat:
        """A format whose weights from ``gguf`` share one huge-page arena: room for every
        packable tensor's bytes (packing adds at most 63 bytes per 16 rows, and 63 per
        matrix for alignment)."""
        return QuantFormat(WeightArena.for_tensors(
            t for t in gguf.tensors.values() if len(t.shape) == 2))

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear:
        parts = [(gguf.tensor_bytes(n), gguf.tensor(n).ggml_type, gguf.tensor(n).shape)
                 for n in names]
        return self._linear(parts, names, gguf.release_view, self._arena)

    def linear_from_raw(self, parts: Sequence[RawPart], names: Sequence[str],
                        alloc: Callable[[int], torch.Tensor] | None = None) -> Linear:
        # raw parts come from elsewhere (experts read from disk may come and go): not from
        # the model's arena, whose bytes are only given back with the whole model, unless
        # the caller gives one (resident experts: WeightArena.for_tensors)
        return self._linear(parts, names, None, alloc)

    @staticmethod
    def _linear(parts: Sequence[RawPart], names: Sequence[str],
                on_packed: Callable[[np.ndarray], None] | None,
                alloc: Callable[[int], torch.Tensor] | None) -> Linear:
        # consecutive packable parts form one QuantLinear; others are dense f32
        layers: list[Linear] = []
        items = zip(parts, names, strict=True)
        for packed, group in groupby(items, key=lambda item: item[0][1] in PACKED_TYPES):
            raw_parts, group_names = zip(*group, strict=True)
            if packed:
                layers.append(QuantLinear.from_raw(raw_parts, group_names, on_packed, alloc))
            else:
                layers.append(DENSE_F32.linear_from_raw(raw_parts, group_names))
        return layers[0] if len(layers) == 1 else ConcatLinear(layers)

    def embedding(self, gguf: GGUFFile, name: str, tied: bool = False) -> Embedding:
        info = gguf.tensor(name)
        if info.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            return DENSE_F32.embedding(gguf, name)
        if tied and info.ggml_type in PACKED_TYPES:
            return PackedEmbedding(QuantLinear.from_raw(
                [(gguf.tensor_bytes(name), info.ggml_type, info.shape)], [name],
                gguf.release_view, self._arena))
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
    return "q4" if kernels.available() else "f32"


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[resolve_weights(name)]
    except KeyError:
        raise ValueError(
            f"unknown weight format {name!r} (choose from {', '.join(WEIGHT_CHOICES)})"
        ) from None


def load_dense(gguf: GGUFFile, name: str) -> torch.Tensor:
    """A GGUF tensor dequantized to float32 in PyTorch shape order; refused, by name,
    when it holds a NaN or an infinity (a norm, bias or scale like that would turn every
    logit of every request into NaN)."""
    info = gguf.tensor(name)
    t = dequantize(gguf.tensor_bytes(name), info.ggml_type, info.shape, name=name)
    if not bool(torch.isfinite(t).all()):
        raise GGUFError(f"{gguf.path.name}: tensor {name!r} holds non-finite values "
                        "(NaN or infinity)")
    return t
