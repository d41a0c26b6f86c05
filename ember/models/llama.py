"""The llama family (Llama 2/3, SmolLM, Mistral-style dense models): the plain block.

Everything is the shared decoder's default (:mod:`ember.models.decoder`): pre-norm
blocks with SwiGLU, adjacent-pair RoPE (llama.cpp's converter permutes HF's Q/K rows
into that layout), no biases or extra norms. It is also the one configuration the
fused native stack implements, so q4 llama models run it.
"""

from __future__ import annotations

from typing import Any

from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    """Nothing differs from the shared defaults."""
    return {}
