"""The llama family (Llama 2/3, SmolLM, Mistral-style dense models, Mixtral): the plain
block.

Everything is the shared decoder's default (:mod:`ember.models.decoder`): pre-norm
blocks with SwiGLU, adjacent-pair RoPE (llama.cpp's converter permutes HF's Q/K rows
into that layout), no biases or extra norms. A file with ``llama.expert_count`` is a
Mixtral-style mixture of experts: every FFN a router over SwiGLU experts of
``feed_forward_length`` (softmax over the chosen top k, as Mixtral routes), stored as
llama.cpp's converter writes them (``ffn_{gate,up,down}_exps``).
"""

from __future__ import annotations

from typing import Any

from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    """Nothing differs from the shared defaults, but a Mixtral-style file's experts."""
    experts = int(gguf.get(f"{base.architecture}.expert_count", 0))
    if not experts:
        return {}
    return {"n_experts": experts,
            "n_experts_used": int(gguf.require(f"{base.architecture}.expert_used_count")),
            "expert_ffn_size": base.ffn_size}
