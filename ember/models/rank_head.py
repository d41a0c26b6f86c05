"""A reranker's classification head, as a GGUF stores it and llama.cpp's rank pooling
runs it: an optional dense layer with tanh (``cls.weight``/``cls.bias``: RoBERTa-style
cross-encoders such as bge-reranker) and an output projection (``cls.output.*``: two
outputs in Qwen3-Reranker, its "yes" and "no" logits; one in a cross-encoder). A head
without either part is read as written (jina-reranker-v1 has no ``cls.output``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.models.gguf import GGUFFile
from ember.models.linear import load_dense

Affine = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class RankHead:
    dense: Affine | None
    output: Affine | None

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head's outputs for one pooled state (hidden,)."""
        x = pooled.float()
        if self.dense is not None:
            x = torch.tanh(_affine(self.dense, x))
        return x if self.output is None else _affine(self.output, x)


def load_rank_head(gguf: GGUFFile) -> RankHead | None:
    """The file's head, or None where it has neither part (not a reranker)."""
    dense, output = (_load(gguf, prefix) for prefix in ("cls", "cls.output"))
    return None if dense is None and output is None else RankHead(dense, output)


def _load(gguf: GGUFFile, prefix: str) -> Affine | None:
    if f"{prefix}.weight" not in gguf.tensors:
        return None
    bias = f"{prefix}.bias"
    return (load_dense(gguf, f"{prefix}.weight"),
            load_dense(gguf, bias) if bias in gguf.tensors else None)


def _affine(part: Affine, x: torch.Tensor) -> torch.Tensor:
    weight, bias = part
    out = weight.float() @ x
    return out if bias is None else out + bias.float()
