"""Qwen 2 and Qwen 3: the llama block with NEOX RoPE, plus Q/K/V biases (Qwen 2) or a
per-head RMSNorm of q and k before RoPE (Qwen 3); Qwen 3 MoE replaces every FFN by
routed experts (:mod:`ember.models.moe`)."""

from __future__ import annotations

from typing import Any

from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile


def configure_qwen2(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    return {"rope_neox": True, "qkv_bias": "blk.0.attn_q.bias" in gguf.tensors}


def configure_qwen3(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    return {"rope_neox": True, "qk_norm": True}


def configure_qwen3moe(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture
    return {**configure_qwen3(gguf, base),
            "n_experts": int(gguf.require(f"{arch}.expert_count")),
            "n_experts_used": int(gguf.require(f"{arch}.expert_used_count")),
            "expert_ffn_size": int(gguf.require(f"{arch}.expert_feed_forward_length"))}
