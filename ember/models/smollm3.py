"""SmolLM3: the llama block, with every fourth layer attending without RoPE (NoPE).

llama.cpp fixes the interval at 4 (the file carries no key for it), as SmolLM3's
config does."""

from __future__ import annotations

from typing import Any

from ember.models.config import LayerAttention, ModelConfig
from ember.models.gguf import GGUFFile

NO_ROPE_INTERVAL = 4  # layer i has no RoPE when (i + 1) % 4 == 0


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    layers = tuple(
        LayerAttention(base.rope_base, None, base.rope_scale,
                       rope=(i + 1) % NO_ROPE_INTERVAL != 0)
        for i in range(base.n_layers))
    return {"layers": layers}
