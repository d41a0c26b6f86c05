"""OLMo 2: the block with its norms moved after the sublayers.

No norm before attention or the MLP (they read the residual stream itself); an
RMSNorm of each sublayer's output before the residual add; q and k RMS-normed across
all their heads at once (weights of heads·head_dim), before NEOX RoPE. Files with a
sliding window (OLMo 3) are refused by name.
"""

from __future__ import annotations

from typing import Any

from ember.errors import UnsupportedModelError
from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    if gguf.get(f"{base.architecture}.attention.sliding_window"):
        raise UnsupportedModelError(f"{gguf.path.name}: {base.architecture} with "
                                    "sliding-window layers (OLMo 3) is not supported")
    return {"rope_neox": True, "pre_norms": False, "post_norms": True, "qk_norm": True,
            "qk_norm_full": True}
