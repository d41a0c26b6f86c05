"""gpt-oss (OpenAI's open-weight MoE): a block of its own kind, spelled in shared options.

- Attention: biases on q, k, v and the output; a learned logit per head joins every
  softmax's denominator ("sinks": a head may attend to nothing); sliding-window
  layers (the file's window, 128 in the released models) alternate with global ones,
  layer i sliding when i is even unless the file gives a pattern; NEOX RoPE with YaRN
  (read by the shared config, corrected dims rounded to whole ones as ggml does).
- FFN: a norm (the file's ``post_attention_norm``, the MLP's pre-norm here), then a
  router with a bias picking ``expert_used_count`` experts by softmax over their logits;
  experts with biases and OpenAI's clamped SwiGLU (mlp.GLUS["swiglu_oai"]).

The released files hold the experts in MXFP4, kept packed for the native kernels under
``--weights q4`` (see docs/models.md); the chat format (harmony) is the file's template.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ember.errors import UnsupportedModelError
from ember.models.config import LayerAttention, ModelConfig
from ember.models.gguf import GGUFFile


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture
    window = int(gguf.require(f"{arch}.attention.sliding_window"))
    layers = tuple(LayerAttention(base.rope_base, window if slides else None, base.rope_scale)
                   for slides in _sliding_layers(gguf, base.n_layers))
    return {"rope_neox": True, "layers": layers, "qkv_bias": True, "attn_out_bias": True,
            "attn_sinks": True, "ffn_norm_tensor": "post_attention_norm",
            "activation": "swiglu_oai", "expert_biases": True,
            "n_experts": int(gguf.require(f"{arch}.expert_count")),
            "n_experts_used": int(gguf.require(f"{arch}.expert_used_count")),
            "expert_ffn_size": int(gguf.require(f"{arch}.expert_feed_forward_length"))}


def _sliding_layers(gguf: GGUFFile, n_layers: int) -> list[bool]:
    """Which layers slide: the file's per-layer pattern, or every n-th pattern (layer i
    slides unless i % n == n - 1), 2 by default — as llama.cpp reads them."""
    key = f"{gguf.architecture}.attention.sliding_window_pattern"
    pattern = gguf.get(key, 2)
    if isinstance(pattern, np.ndarray | list):
        if len(pattern) != n_layers:
            raise UnsupportedModelError(f"{gguf.path.name}: {key} has {len(pattern)} "
                                        f"entries for {n_layers} layers")
        return [bool(x) for x in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(n_layers)]
