"""Gemma 2: Gemma 3's block without q/k norms, with soft-capped scores and logits.

- Sliding-window layers alternate with global ones (layer i slides when i is even),
  all at one RoPE base; NEOX RoPE.
- Attention scores and final logits soft-capped: s -> c·tanh(s/c), with
  ``attn_logit_softcapping`` and ``final_logit_softcapping``.
- Queries scaled by 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 46-layer 27B (as
  llama.cpp does); post-norms after each sublayer, GeGLU, embeddings times sqrt(hidden).
"""

from __future__ import annotations

import math
from typing import Any

from ember.models.config import LayerAttention, ModelConfig
from ember.models.gguf import GGUFFile

DEFAULT_WINDOW = 4096  # llama.cpp's default for files without the key


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture
    window = int(gguf.get(f"{arch}.attention.sliding_window", DEFAULT_WINDOW))
    layers = tuple(
        LayerAttention(base.rope_base, window if i % 2 == 0 else None, base.rope_scale)
        for i in range(base.n_layers))
    per_head = base.hidden_size // base.n_heads if base.n_layers == 46 else base.head_dim
    return {"rope_neox": True, "layers": layers, "attn_scale": 1.0 / math.sqrt(per_head),
            "embed_scale": math.sqrt(base.hidden_size), "post_norms": True,
            "activation": "gelu_tanh",
            "attn_softcap": float(gguf.get(f"{arch}.attn_logit_softcapping", 0.0)),
            "final_softcap": float(gguf.get(f"{arch}.final_logit_softcapping", 0.0))}
