"""Granite 3.x (dense): the llama block with four scalar multipliers from the file —
embeddings times ``embedding_scale``, each sublayer's output times ``residual_scale``
before the residual add, attention scores times ``attention.scale`` (in place of
1/sqrt(head_dim)), logits divided by ``logit_scale``."""

from __future__ import annotations

from typing import Any

from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture
    out: dict[str, Any] = {
        "embed_scale": float(gguf.get(f"{arch}.embedding_scale", 1.0)),
        "residual_scale": float(gguf.get(f"{arch}.residual_scale", 1.0)),
        "logit_scale": 1.0 / float(gguf.require(f"{arch}.logit_scale"))}
    attention = gguf.get(f"{arch}.attention.scale")
    if attention:
        out["attn_scale"] = float(attention)
    return out
