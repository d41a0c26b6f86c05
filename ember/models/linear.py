"""The weight seam: how a linear layer's weights are stored and multiplied.

Model code only ever calls ``layer(x)`` on a :class:`Linear`; which bytes back it
(float32 dequantized from GGUF, bfloat16, or packed int8/int4 later) is decided
here by a :class:`WeightFormat`, so a faster representation never touches the
model files. Several GGUF tensors can be fused into one layer (QKV, gate/up),
concatenated along the output dimension, so each step does one matmul for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from ember.models.gguf import GGUFFile
from ember.models.quant import dequantize


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


class WeightFormat(Protocol):
    name: str

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear: ...


class DenseFormat:
    """Dequantize every weight to a dense tensor of ``dtype``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.name = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]

    def linear(self, gguf: GGUFFile, names: Sequence[str]) -> Linear:
        parts = [load_dense(gguf, n).to(self.dtype) for n in names]
        return DenseLinear(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "f32": DenseFormat(torch.float32),
    "bf16": DenseFormat(torch.bfloat16),
}


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown weight format {name!r} (choose from {', '.join(WEIGHT_FORMATS)})"
        ) from None


def load_dense(gguf: GGUFFile, name: str) -> torch.Tensor:
    """A GGUF tensor dequantized to float32 in PyTorch shape order."""
    info = gguf.tensor(name)
    return dequantize(gguf.tensor_bytes(name), info.ggml_type, info.shape, name=name)
