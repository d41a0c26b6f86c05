"""Rotary position embeddings (RoPE): rotations looked up once per step, applied per layer.

RoPE layout: llama.cpp's converter permutes the Q/K rows of HF llama checkpoints so
that a GGUF llama rotates *adjacent* pairs (x[2i], x[2i+1]) — ggml's "normal" rope —
while Qwen and Gemma GGUFs keep HF's NEOX layout (x[i], x[i + d/2]). Using the wrong
one silently scrambles attention; the transformers oracle tests guard both.
"""

from __future__ import annotations

import math

import torch

from ember.models.config import LayerAttention, ModelConfig, Yarn


class RotaryEmbedding:
    """RoPE over the first ``rope_dim`` head dims, as complex rotations.

    Each pair — adjacent dims, or dims ``rope_dim/2`` apart with ``neox`` — is a
    complex number multiplied by e^(i·pos·θ_i): one complex multiply per call instead
    of a dozen real ops, and the per-position rotations are looked up once per forward
    pass (``rotation``), not once per layer.
    """

    def __init__(self, rope_dim: int, base: float, freq_factors: torch.Tensor | None = None,
                 neox: bool = False, scale: float = 1.0, enabled: bool = True,
                 attn_factor: float = 1.0, yarn: Yarn | None = None) -> None:
        half = rope_dim // 2
        inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rope_dim) / scale
        if yarn is not None:
            inv_freq = _yarn_blend(inv_freq, rope_dim, base, yarn)
        if freq_factors is not None:  # llama3/LongRoPE per-frequency factors
            inv_freq = inv_freq / freq_factors.double()
        # a layer without RoPE rotates by e^0 = 1: the same table shape, so both the
        # op-by-op path and the native stack run it without a special case
        self.inv_freq = inv_freq if enabled else torch.zeros_like(inv_freq)
        self.magnitude = attn_factor if enabled else 1.0
        self.rope_dim = rope_dim
        self.neox = neox
        self._table = torch.empty(0, half, dtype=torch.complex64)

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """e^(i·pos·θ) for each position: complex (T, 1, rope_dim/2), broadcast over heads."""
        if positions.numel() and int(positions.max()) >= self._table.shape[0]:
            n = max(int(positions.max()) + 1, 2 * self._table.shape[0], 256)
            angles = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            magnitude = torch.full_like(angles, self.magnitude)
            self._table = torch.polar(magnitude, angles).to(torch.complex64)
        return self._table[positions][:, None, :]

    def apply(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (T, heads, head_dim) by ``rotation`` from ``rotation()``."""
        d = self.rope_dim
        head = x if d == x.shape[-1] else x[..., :d]
        if self.neox:  # pair dim i with dim i + d/2: as (d/2, 2) after a transpose
            pairs = head.unflatten(-1, (2, -1)).transpose(-1, -2).contiguous()
            rotated = torch.view_as_real(torch.view_as_complex(pairs) * rotation)
            rotated = rotated.transpose(-1, -2).flatten(-2)
        else:
            pairs = head.contiguous().unflatten(-1, (-1, 2))
            rotated = torch.view_as_real(torch.view_as_complex(pairs) * rotation).flatten(-2)
        return rotated if d == x.shape[-1] else torch.cat((rotated, x[..., d:]), dim=-1)


def _yarn_blend(inv_freq: torch.Tensor, dim: int, base: float, yarn: Yarn) -> torch.Tensor:
    """YaRN: each frequency between itself (dims turning often over the original
    context) and itself / factor (dims turning rarely), by a ramp over the dims between
    the two correction dims (floored and ceiled, as transformers and ggml do)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_context / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    span = (high - low) or 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as it is), 0: interpolate
    return inv_freq / yarn.factor * (1 - keep) + inv_freq * keep


RopeKey = tuple[float, float, bool]


def rope_key(kind: LayerAttention) -> RopeKey:
    return kind.rope_base, kind.rope_scale, kind.rope


def rope_keys(cfg: ModelConfig) -> list[RopeKey]:
    """The distinct RoPEs of the layers, in first-use order (the stack's table list)."""
    return list(dict.fromkeys(rope_key(cfg.layer_attention(i)) for i in range(cfg.n_layers)))


def attention_temperature(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor | None:
    """What each token's queries are multiplied by under Llama 4's attention temperature
    (Mistral 3): 1 + scale·ln(1 + ⌊position / floor⌋), shape (T,); None without one.
    Longer-range tokens get sharper attention; within the first ``floor`` positions
    (the original context) the factor is 1."""
    if not cfg.attn_temperature_scale:
        return None
    steps = torch.floor(positions.double() / cfg.attn_temperature_floor)
    return (1.0 + cfg.attn_temperature_scale * torch.log1p(steps)).float()
