"""Mistral 3 / Ministral 3 (dense): the llama block with YaRN RoPE (read by the shared
config) and Llama 4's attention temperature: past the original context, queries grow
by 1 + β·ln(1 + ⌊position / original context⌋), sharpening attention at long range.
llama.cpp takes the original context as the temperature's floor, as transformers does.

Mistral 4 (the same architecture name's MoE with multi-head latent attention) is
refused by name."""

from __future__ import annotations

from typing import Any

from ember.errors import UnsupportedModelError
from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture
    if gguf.get(f"{arch}.expert_count"):
        raise UnsupportedModelError(f"{gguf.path.name}: mixture-of-experts {arch} files "
                                    f"({arch}.expert_count) are not supported")
    scale = float(gguf.get(f"{arch}.attention.temperature_scale", 0.0))
    if not scale:
        return {}
    floor = int(gguf.get(f"{arch}.rope.scaling.original_context_length", 0))
    if floor <= 0:
        raise UnsupportedModelError(
            f"{gguf.path.name}: attention temperature needs "
            f"{arch}.rope.scaling.original_context_length")
    return {"attn_temperature_scale": scale, "attn_temperature_floor": floor}
