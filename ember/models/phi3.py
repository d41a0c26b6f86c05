"""Phi 3 / 3.5 / 4-mini: the llama block with its projections fused by the converter.

- ``attn_qkv`` holds q, k and v rows in one tensor and ``ffn_up`` holds gate then up
  (the decoder loads either spelling); NEOX RoPE, possibly over part of each head
  (Phi-4-mini rotates 3/4 of it: ``rope.dimension_count``).
- LongRoPE (Phi-3.5 / 4-mini's 128k files): per-frequency factors, a short set for
  contexts up to the original training length and a long one beyond it, and cos/sin
  scaled by an attention factor. ember rotates by the short set and serves up to the
  original length, where it is exact (transformers switches sets by length and
  llama.cpp by its context size; rotating positions past it needs the long set).
- The sliding window some files declare is ignored, as llama.cpp does (its
  converters record it inconsistently).
"""

from __future__ import annotations

import logging
from typing import Any

from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile

log = logging.getLogger(__name__)


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture
    out: dict[str, Any] = {"rope_neox": True}
    # llama.cpp's converter marks a LongRoPE file by its factor tensors and attention
    # factor (the scaling type key is written by some converters, not by all)
    if "rope_factors_short.weight" in gguf.tensors:
        original = int(gguf.require(f"{arch}.rope.scaling.original_context_length"))
        out |= {"rope_factors_tensor": "rope_factors_short.weight",
                "rope_attn_factor": float(gguf.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
                "context_length": min(base.context_length, original)}
        if base.context_length > original:
            log.warning("%s: LongRoPE model served up to its original context of %d tokens "
                        "(of %d): longer contexts need the long factors, not implemented",
                        gguf.path.name, original, base.context_length)
    return out
