"""Random-weight GGUFs with the real shapes of the models people run (``ember bench synth``).

Decode speed depends on a model's shapes and tensor types, not on its weight values,
and it has to be measured at the sizes people run (1-8B, and mixtures of experts of
20-30B): a model that fits in the CPU's last-level cache measures the cache, not the
engine. No such model ships on PyPI, so this writes them: ``SHAPES`` holds the exact
hyper-parameters of Llama 3.2 1B/3B, Llama 3.1 8B, Qwen3 4B, Qwen3-Embedding 0.6B, Gemma
3 1B, Qwen3-30B-A3B (128 experts, 8 per token), gpt-oss-20b (32 experts, 4 per token,
sinks and biases) and the Qwen 3.5 hybrids 0.8B, 4B and 35B-A3B (three Gated DeltaNet
layers to one of gated attention), and ``write_synth`` writes one of them at a llama.cpp
file type (``Q4_K_M``, ..., ``MXFP4_MOE`` as gpt-oss ships) with the per-tensor types
llama-quantize would choose (``tensor_type``), so ember and llama.cpp read the same
bytes per token as they would from the real model's GGUF. ``layers`` cuts a shape's
depth to what a machine holds (every layer is the real one; a step's cost scales with
their number).

Weights are random code bytes with each block's scales set so that the dequantized
weights have a standard deviation of about 1/sqrt(in_features): finite, and the model
runs and samples through all its layers (the text is noise). A router of random
weights spreads tokens about evenly over the experts, as a worst case for a cache. The
tokenizer is a real one (SmolLM2's by default) padded with unused placeholder tokens
up to the shape's vocabulary, so the embedding and head keep their real sizes and
text still tokenizes. Tensors are generated a few MB at a time and streamed to the
file (``ember.models.gguf.write_gguf``): an 8B model needs no more memory than that.

Not reproduced: Llama 3's ``rope_freqs.weight`` (its long-context RoPE factors: 64
floats that ember does not read and that cost nothing per token).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ember.models.gguf import (
    BLOCK_GEOMETRY,
    GGMLType,
    GGUFFile,
    TensorToWrite,
    write_gguf,
)

CHUNK_BYTES = 4 << 20  # bytes generated (and held) at a time
UNUSED_TOKEN = 5  # GGUF token type of the placeholder tokens (llama.cpp's LLAMA_TOKEN_TYPE_UNUSED)


@dataclass(frozen=True)
class Shape:
    """A decoder's hyper-parameters, as its GGUF states them."""

    name: str
    arch: str  # general.architecture: llama, qwen3 or gemma3
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool  # no output.weight: the head is the token embedding
    rope_base: float
    context: int
    norm_eps: float
    sliding_window: int = 0  # gemma3: its local layers' window; gpt-oss: every other layer's
    n_experts: int = 0  # routed experts per layer (0: a dense FFN of ``ffn``)
    n_experts_used: int = 0  # experts per token
    expert_ffn: int = 0  # each expert's FFN width
    yarn: tuple[float, int] = (0.0, 0)  # YaRN (factor, original context); 0: none
    # Qwen 3.5: (conv taps, key heads, key dim, value heads, value dim) of its Gated
    # DeltaNet layers, every full_attention_interval-th layer attention, RoPE over the
    # leading rope_dim dims of a head, a shared expert of shared_expert_ffn
    delta_net: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    full_attention_interval: int = 0
    rope_dim: int = 0  # 0: the whole head
    shared_expert_ffn: int = 0
    pooling: int = 0  # an embedder's {arch}.pooling_type (3: last token); 0: none written
    description: str = ""

    def __post_init__(self) -> None:
        if self.arch not in _ARCH_EXTRAS:
            raise ValueError(f"shape {self.name!r}: architecture {self.arch!r} is not one "
                             f"synth writes ({', '.join(_ARCH_EXTRAS)})")
        if (self.arch in _WINDOWED) != (self.sliding_window > 0):
            raise ValueError(f"shape {self.name!r}: {' and '.join(sorted(_WINDOWED))}, and "
                             f"only they, need a sliding_window (got {self.sliding_window})")
        if (self.arch in _ROUTED) != (self.n_experts > 0) or (self.n_experts and not (
                0 < self.n_experts_used <= self.n_experts and self.expert_ffn > 0)):
            raise ValueError(f"shape {self.name!r}: {' and '.join(sorted(_ROUTED))}, and "
                             "only they, need experts (n_experts, n_experts_used <= "
                             "n_experts, expert_ffn)")
        if (self.arch in _HYBRID) != bool(self.full_attention_interval and self.delta_net[0]):
            raise ValueError(f"shape {self.name!r}: {' and '.join(sorted(_HYBRID))}, and only "
                             "they, need delta_net and full_attention_interval")

    def recurrent(self, layer: int) -> bool:
        """Whether ``layer`` is a Gated DeltaNet layer (a hybrid's, not every interval-th)."""
        return self.arch in _HYBRID and (layer + 1) % self.full_attention_interval != 0

    def with_layers(self, n_layers: int | None) -> Shape:
        """The same shape cut (or grown) to ``n_layers`` of its real layers, named so."""
        if n_layers is None or n_layers == self.n_layers:
            return self
        if n_layers < 1:
            raise ValueError(f"layers must be at least 1, got {n_layers}")
        return dataclasses.replace(self, name=f"{self.name}-{n_layers}l", n_layers=n_layers,
                                   description=f"{self.description}, {n_layers} of its "
                                               f"{self.n_layers} layers")


# arch -> (per-head q/k RMSNorm, norms after each sublayer too)
_ARCH_EXTRAS: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "qwen3": (True, False),
    "gemma3": (True, True),
    "qwen3moe": (True, False),
    "gpt-oss": (False, False),
    "qwen35": (True, False),
    "qwen35moe": (True, False),
}
_WINDOWED = {"gemma3", "gpt-oss"}  # sliding-window layers
_ROUTED = {"qwen3moe", "gpt-oss", "qwen35moe"}  # every FFN routed over experts
# Qwen 3.5: Gated DeltaNet layers, gated attention (q heads carry an output gate), the
# FFN's pre-norm called post_attention_norm
_HYBRID = {"qwen35", "qwen35moe"}
# gpt-oss: biases on q, k, v, the output, the router and every expert; per-head sinks; the
# FFN's pre-norm is called post_attention_norm
_BIASED = {"gpt-oss"}

SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-1b", "llama", hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8,
              head_dim=64, ffn=8192, vocab=128256, tied=True, rope_base=500000.0,
              context=131072, norm_eps=1e-5, description="Llama 3.2 1B"),
        Shape("llama-3b", "llama", hidden=3072, n_layers=28, n_heads=24, n_kv_heads=8,
              head_dim=128, ffn=8192, vocab=128256, tied=True, rope_base=500000.0,
              context=131072, norm_eps=1e-5, description="Llama 3.2 3B"),
        Shape("llama-8b", "llama", hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
              head_dim=128, ffn=14336, vocab=128256, tied=False, rope_base=500000.0,
              context=131072, norm_eps=1e-5, description="Llama 3.1 8B"),
        # Qwen3-Embedding-0.6B: Qwen3 0.6B's decoder, read at its last token
        Shape("qwen3-embedding-0.6b", "qwen3", hidden=1024, n_layers=28, n_heads=16,
              n_kv_heads=8, head_dim=128, ffn=3072, vocab=151669, tied=True,
              rope_base=1e6, context=32768, norm_eps=1e-6, pooling=3,
              description="Qwen3-Embedding 0.6B"),
        Shape("qwen3-4b", "qwen3", hidden=2560, n_layers=36, n_heads=32, n_kv_heads=8,
              head_dim=128, ffn=9728, vocab=151936, tied=True, rope_base=1e6,
              context=40960, norm_eps=1e-6, description="Qwen3 4B"),
        # Local layers' RoPE base 10,000 and the pattern of 6 are what both ember
        # (models/gemma3.py) and llama.cpp assume when the GGUF says nothing, as
        # Google's own GGUFs do; so this writes neither key.
        Shape("gemma3-1b", "gemma3", hidden=1152, n_layers=26, n_heads=4, n_kv_heads=1,
              head_dim=256, ffn=6912, vocab=262144, tied=True, rope_base=1e6,
              context=32768, norm_eps=1e-6, sliding_window=512, description="Gemma 3 1B"),
        # ffn: the dense width its config states (no layer uses it; llama.cpp reads the
        # experts' own)
        Shape("qwen3moe-30b-a3b", "qwen3moe", hidden=2048, n_layers=48, n_heads=32,
              n_kv_heads=4, head_dim=128, ffn=6144, vocab=151936, tied=False,
              rope_base=1e6, context=40960, norm_eps=1e-6, n_experts=128, n_experts_used=8,
              expert_ffn=768, description="Qwen3-30B-A3B"),
        Shape("gpt-oss-20b", "gpt-oss", hidden=2880, n_layers=24, n_heads=64, n_kv_heads=8,
              head_dim=64, ffn=2880, vocab=201088, tied=False, rope_base=150000.0,
              context=131072, norm_eps=1e-5, sliding_window=128, n_experts=32,
              n_experts_used=4, expert_ffn=2880, yarn=(32.0, 4096),
              description="gpt-oss-20b"),
        # Qwen 3.5: RoPE over a quarter of each 256-dim head (interleaved MRoPE sections
        # 11/11/10 in the file; for text one position, plain NEOX), base 1e7
        Shape("qwen35-0.8b", "qwen35", hidden=1024, n_layers=24, n_heads=8, n_kv_heads=2,
              head_dim=256, ffn=3584, vocab=248320, tied=True, rope_base=1e7,
              context=262144, norm_eps=1e-6, delta_net=(4, 16, 128, 16, 128),
              full_attention_interval=4, rope_dim=64, description="Qwen3.5 0.8B"),
        Shape("qwen35-4b", "qwen35", hidden=2560, n_layers=32, n_heads=16, n_kv_heads=4,
              head_dim=256, ffn=9216, vocab=248320, tied=True, rope_base=1e7,
              context=262144, norm_eps=1e-6, delta_net=(4, 16, 128, 32, 128),
              full_attention_interval=4, rope_dim=64, description="Qwen3.5 4B"),
        Shape("qwen35moe-35b-a3b", "qwen35moe", hidden=2048, n_layers=40, n_heads=16,
              n_kv_heads=2, head_dim=256, ffn=512, vocab=248320, tied=False,
              rope_base=1e7, context=262144, norm_eps=1e-6, n_experts=256,
              n_experts_used=8, expert_ffn=512, delta_net=(4, 16, 128, 32, 128),
              full_attention_interval=4, rope_dim=64, shared_expert_ffn=512,
              description="Qwen3.5 35B-A3B"),
    )
}


@dataclass(frozen=True)
class FileType:
    """A llama.cpp file type: its ``general.file_type`` number (llama_ftype) and the
    tensor type its matrices get unless the mixture rules say otherwise."""

    name: str
    ftype: int
    default: GGMLType


FILE_TYPES: dict[str, FileType] = {
    f.name: f
    for f in (
        FileType("Q4_0", 2, GGMLType.Q4_0),
        FileType("Q4_1", 3, GGMLType.Q4_1),
        FileType("Q8_0", 7, GGMLType.Q8_0),
        FileType("Q5_0", 8, GGMLType.Q5_0),
        FileType("Q5_1", 9, GGMLType.Q5_1),
        FileType("Q4_K_M", 15, GGMLType.Q4_K),
        FileType("Q5_K_M", 17, GGMLType.Q5_K),
        FileType("Q6_K", 18, GGMLType.Q6_K),
        # experts in MXFP4, every other matrix Q8_0: how gpt-oss's GGUFs ship
        FileType("MXFP4_MOE", 38, GGMLType.MXFP4),
    )
}


def file_type(name: str) -> FileType:
    try:
        return FILE_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown file type {name!r} (choose from "
                         f"{', '.join(FILE_TYPES)})") from None


def shape_named(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})") from None


# ------------------------------------------------------------------ type policy

_K_FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1,
               GGMLType.Q6_K: GGMLType.Q8_0}


def _block(t: GGMLType) -> int:
    return BLOCK_GEOMETRY[t][0]


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def tensor_type(name: str, shape: tuple[int, ...], file_type_name: str, *, n_layers: int,
                tied: bool, n_experts: int = 0) -> GGMLType:
    """The type llama-quantize gives tensor ``name`` (torch ``shape``) in a file of
    type ``file_type_name``, from an F32/F16 source without an importance matrix.

    Mirrors llama.cpp's ``llama_tensor_get_type`` (src/llama-quant.cpp, as vendored in
    llama-cpp-python 0.3.36): ``tensor_allows_quantization`` (1-D tensors, biases, norms,
    the experts' router ``ffn_gate_inp`` and ``ssm_conv1d`` stay as they are: F32 here),
    ``llama_tensor_get_type_impl`` for the branches these file types reach in models
    below 70B (the output head, or the token embedding when tied, becomes Q6_K, or Q8_0
    when its row length is not a multiple of the default type's block; for Q4_K_M /
    Q5_K_M, attn_v (and a hybrid's attn_qkv, which llama.cpp counts with attn_v) and
    ffn_down (the experts' too) become Q6_K in the layers
    ``use_more_bits`` picks; with exactly 8 experts attn_v and attn_k become Q8_0 and,
    for Q4_K_M, attn_output Q5_K; ``MXFP4_MOE`` puts 3-D expert tensors in MXFP4 and
    every other matrix, the head too, in Q8_0), then ``tensor_type_fallback`` (a K-quant
    whose row length is not a multiple of 256 becomes Q5_0 / Q5_1 / Q8_0, and F16 if
    even that block does not fit). llama.cpp counts attn_v / ffn_down tensors in file
    order; with one per layer, written in layer order, the count is the layer index
    used here (for experts llama.cpp reads the layer from the name, as here).
    """
    ft = file_type(file_type_name)
    if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name \
            or "ffn_gate_inp.weight" in name or "ssm_conv1d" in name:
        return GGMLType.F32
    new = ft.default
    ncols = shape[-1]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if ft.name == "MXFP4_MOE" or ncols % _block(new):
            new = GGMLType.Q8_0
        elif new != GGMLType.Q8_0:
            new = GGMLType.Q6_K
    elif ft.name == "MXFP4_MOE":
        new = GGMLType.MXFP4 if len(shape) == 3 else GGMLType.Q8_0
    elif "attn_v.weight" in name or "attn_qkv.weight" in name or "ffn_down" in name:
        # llama.cpp counts attn_qkv with attn_v (a hybrid has one of them per layer)
        if ft.name in ("Q4_K_M", "Q5_K_M") and _use_more_bits(_layer_of(name), n_layers):
            new = GGMLType.Q6_K
        if n_experts == 8 and "ffn_down" not in name:
            new = GGMLType.Q8_0
    elif n_experts == 8 and "attn_k.weight" in name:
        new = GGMLType.Q8_0
    elif n_experts == 8 and "attn_output.weight" in name and ft.name == "Q4_K_M":
        new = GGMLType.Q5_K
    if ncols % _block(new):
        new = _K_FALLBACK.get(new, new)
        if ncols % _block(new):
            new = GGMLType.F16
    return new


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"tensor {name!r} is not in a block (blk.N.)")
    return int(m.group(1))


def synth_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch shape) of every tensor of ``shape``: token_embd, each block in
    layer order, output_norm, output (readers look tensors up by name; llama-quantize
    itself writes them sorted by name within each block)."""
    h, v, hd = shape.hidden, shape.vocab, shape.head_dim
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    qk_norm, post_norms = _ARCH_EXTRAS[shape.arch]
    biased = shape.arch in _BIASED
    hybrid = shape.arch in _HYBRID
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (v, h))]
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        if shape.recurrent(i):
            out += _delta_net_tensors(shape, p)
            out += _expert_tensors(shape, p) if shape.n_experts else _dense_ffn(shape, p)
            continue
        # a hybrid's q rows: each head's query, then its output gate
        q_rows = 2 * q if hybrid else q
        out += [(p + "attn_norm.weight", (h,)), (p + "attn_q.weight", (q_rows, h)),
                (p + "attn_k.weight", (kv, h)), (p + "attn_v.weight", (kv, h))]
        if biased:
            out += [(p + "attn_q.bias", (q,)), (p + "attn_k.bias", (kv,)),
                    (p + "attn_v.bias", (kv,)), (p + "attn_sinks.weight", (shape.n_heads,))]
        if qk_norm:
            out += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]
        out.append((p + "attn_output.weight", (h, q)))
        if biased:
            out.append((p + "attn_output.bias", (h,)))
        if post_norms:
            out.append((p + "post_attention_norm.weight", (h,)))
        if shape.n_experts:
            out += _expert_tensors(shape, p)
            continue
        out += _dense_ffn(shape, p)
        if post_norms:
            out.append((p + "post_ffw_norm.weight", (h,)))
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (v, h)))
    return out


def _ffn_norm(shape: Shape) -> str:
    return ("post_attention_norm" if shape.arch in _BIASED | _HYBRID else "ffn_norm") + ".weight"


def _dense_ffn(shape: Shape, p: str) -> list[tuple[str, tuple[int, ...]]]:
    h, f = shape.hidden, shape.ffn
    return [(p + _ffn_norm(shape), (h,)), (p + "ffn_gate.weight", (f, h)),
            (p + "ffn_up.weight", (f, h)), (p + "ffn_down.weight", (h, f))]


def _delta_net_tensors(shape: Shape, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A Qwen 3.5 Gated DeltaNet layer's mixer (as llama.cpp's converter names them)."""
    h = shape.hidden
    taps, n_k, k_dim, n_v, v_dim = shape.delta_net
    channels, value = 2 * n_k * k_dim + n_v * v_dim, n_v * v_dim
    return [(p + "attn_norm.weight", (h,)), (p + "attn_qkv.weight", (channels, h)),
            (p + "attn_gate.weight", (value, h)), (p + "ssm_conv1d.weight", (channels, taps)),
            (p + "ssm_dt.bias", (n_v,)), (p + "ssm_a", (n_v,)),
            (p + "ssm_beta.weight", (n_v, h)), (p + "ssm_alpha.weight", (n_v, h)),
            (p + "ssm_norm.weight", (v_dim,)), (p + "ssm_out.weight", (h, value))]


def _expert_tensors(shape: Shape, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A routed layer's FFN: its pre-norm, the router, the experts' [E, out, in] stacks
    (and gpt-oss's biases; Qwen 3.5 MoE's shared expert)."""
    h, e, f = shape.hidden, shape.n_experts, shape.expert_ffn
    biased = shape.arch in _BIASED
    out = [(p + _ffn_norm(shape), (h,)), (p + "ffn_gate_inp.weight", (e, h))]
    if biased:
        out.append((p + "ffn_gate_inp.bias", (e,)))
    out += [(p + "ffn_gate_exps.weight", (e, f, h)), (p + "ffn_up_exps.weight", (e, f, h)),
            (p + "ffn_down_exps.weight", (e, h, f))]
    if biased:
        out += [(p + "ffn_gate_exps.bias", (e, f)), (p + "ffn_up_exps.bias", (e, f)),
                (p + "ffn_down_exps.bias", (e, h))]
    if shape.shared_expert_ffn:
        s = shape.shared_expert_ffn
        out += [(p + "ffn_gate_inp_shexp.weight", (h,)), (p + "ffn_gate_shexp.weight", (s, h)),
                (p + "ffn_up_shexp.weight", (s, h)), (p + "ffn_down_shexp.weight", (h, s))]
    return out


# ------------------------------------------------------------------ random blocks


def _uniform_moments(n: int, shift: float = 0.0) -> tuple[float, float]:
    """Mean and mean square of ``k - shift`` for k uniform on 0..n-1."""
    mean = (n - 1) / 2 - shift
    return mean, (n * n - 1) / 12 + mean * mean


def _affine_rms(code_levels: int, code_shift: float) -> float:
    """RMS of ``q - shift`` (d = 1) for uniform codes: the 32-element formats."""
    return _uniform_moments(code_levels, code_shift)[1] ** 0.5


def _k_rms(code_levels: int) -> float:
    """RMS of ``sc*q - c*mn`` for uniform 6-bit sc, mn and codes q, with the min's
    super-scale set to c = (levels - 1) / 2 times d (so the mean is 0): Q4_K, Q5_K."""
    c = (code_levels - 1) / 2
    s1, s2 = _uniform_moments(64)
    q1, q2 = _uniform_moments(code_levels)
    return (s2 * q2 - 2 * c * s1 * q1 * s1 + c * c * s2) ** 0.5


@dataclass(frozen=True)
class _Fill:
    """How a block type's random bytes become weights of a chosen spread: the f16
    fields to set, as (byte offset, value / d), and the RMS of the dequantized values
    of random codes (and random sub-scales) when d = 1."""

    fields: tuple[tuple[int, float], ...]
    unit_rms: float


_FILLS: dict[GGMLType, _Fill] = {
    # q8: int8 codes; q4_0 / q5_0: codes centred by -8 / -16
    GGMLType.Q8_0: _Fill(((0, 1.0),), _affine_rms(256, 128)),
    GGMLType.Q4_0: _Fill(((0, 1.0),), _affine_rms(16, 8)),
    GGMLType.Q5_0: _Fill(((0, 1.0),), _affine_rms(32, 16)),
    # "_1": value = q*d + m, m = -(levels-1)/2 * d centres the codes
    GGMLType.Q4_1: _Fill(((0, 1.0), (2, -7.5)), _affine_rms(16, 7.5)),
    GGMLType.Q5_1: _Fill(((0, 1.0), (2, -15.5)), _affine_rms(32, 15.5)),
    # K-quants: value = d*sc*q - dmin*mn
    GGMLType.Q4_K: _Fill(((0, 1.0), (2, 7.5)), _k_rms(16)),
    GGMLType.Q5_K: _Fill(((0, 1.0), (2, 15.5)), _k_rms(32)),
    # Q6_K: value = d * scale_i8 * (q - 32), d at byte 208
    GGMLType.Q6_K: _Fill(((208, 1.0),), (_uniform_moments(256, 128)[1]
                                         * _uniform_moments(64, 32)[1]) ** 0.5),
}


# MXFP4: a code's value is 2^(e - 128) times one of ggml's kvalues_mxfp4 (its E8M0 "half"
# scale); the RMS of those 16 values for uniform codes
_MXFP4_CENTRE = 128
_MXFP4_UNIT_RMS = (2 * sum(v * v for v in (0, 1, 2, 3, 4, 6, 8, 12)) / 16) ** 0.5


def _random_chunks(rng: np.random.Generator, shape: tuple[int, ...], t: GGMLType,
                   name: str) -> Iterator[np.ndarray]:
    """The raw bytes of a random tensor, a few MB of rows at a time."""
    if name.endswith("ssm_a"):  # -exp(A_log), A_log = log U(1, 16) as Qwen 3.5 is initialised:
        # every head's state decays (a positive value would make it grow without bound)
        yield (-rng.uniform(1.0, 16.0, shape[0])).astype(np.float32)
        return
    if len(shape) == 1:  # norm weights around 1 (GGUF stores Gemma's as 1 + w too); biases
        # and sinks around 0
        centre = 1.0 if name.endswith("norm.weight") else 0.0
        yield (centre + 0.1 * rng.standard_normal(shape[0])).astype(np.float32)
        return
    rows, cols = shape[0], shape[-1]
    for d in shape[1:-1]:
        rows *= d
    sigma = cols ** -0.5
    block_elems, block_bytes = BLOCK_GEOMETRY[t]
    row_bytes = cols // block_elems * block_bytes
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if t in (GGMLType.F32, GGMLType.F16):
            dtype = np.float32 if t == GGMLType.F32 else np.float16
            yield (sigma * rng.standard_normal((n, cols), dtype=np.float32)).astype(dtype)
            continue
        buf = np.frombuffer(bytearray(rng.bytes(n * row_bytes)), dtype=np.uint8)
        blocks = buf.reshape(-1, block_bytes)
        if t == GGMLType.MXFP4:  # one E8M0 exponent byte, then 32 4-bit codes
            blocks[:, 0] = _MXFP4_CENTRE + round(np.log2(sigma / _MXFP4_UNIT_RMS))
            yield buf
            continue
        fill = _FILLS.get(t)
        if fill is None:
            raise ValueError(f"tensor {name!r}: synth cannot write type {t.name}")
        d = sigma / fill.unit_rms
        for offset, times in fill.fields:
            blocks[:, offset:offset + 2] = np.frombuffer(np.float16(d * times).tobytes(),
                                                         dtype=np.uint8)
        yield buf


# ------------------------------------------------------------------ the file


def tokenizer_metadata(src: GGUFFile, vocab: int) -> dict[str, Any]:
    """Every ``tokenizer.*`` key of ``src``, with its per-token arrays padded to
    ``vocab`` entries by ``<|reserved_N|>`` tokens of type UNUSED (score 0)."""
    md = {k: v for k, v in src.metadata.items() if k.startswith("tokenizer.")}
    tokens = list(md.get("tokenizer.ggml.tokens", []))
    n = len(tokens)
    if not n:
        raise ValueError(f"{src.path}: no tokenizer.ggml.tokens to borrow")
    if n > vocab:
        raise ValueError(f"{src.path.name} has {n} tokens, more than the shape's "
                         f"vocabulary of {vocab}")
    pad = [f"<|reserved_{i}|>" for i in range(vocab - n)]
    clash = set(pad).intersection(tokens)
    if clash:
        raise ValueError(f"{src.path.name} already has placeholder token(s) "
                         f"{sorted(clash)[:3]}")
    md["tokenizer.ggml.tokens"] = tokens + pad
    types = md.get("tokenizer.ggml.token_type")
    types = np.ones(n, np.int32) if types is None else np.asarray(types, np.int32)
    md["tokenizer.ggml.token_type"] = np.concatenate(
        [types, np.full(vocab - n, UNUSED_TOKEN, np.int32)])
    if "tokenizer.ggml.scores" in md:
        md["tokenizer.ggml.scores"] = np.concatenate(
            [np.asarray(md["tokenizer.ggml.scores"], np.float32), np.zeros(vocab - n, np.float32)])
    return md


def model_metadata(shape: Shape, quant: str) -> dict[str, Any]:
    """The general.* and {arch}.* keys (uint32 integers, float32 floats, as the
    converter writes them)."""
    a = shape.arch
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.type": "model",
        "general.name": f"synth {shape.name} {quant} (random weights)",
        "general.alignment": 32,
        f"{a}.vocab_size": shape.vocab,
        f"{a}.context_length": shape.context,
        f"{a}.embedding_length": shape.hidden,
        f"{a}.block_count": shape.n_layers,
        f"{a}.feed_forward_length": shape.ffn,
        f"{a}.attention.head_count": shape.n_heads,
        f"{a}.attention.head_count_kv": shape.n_kv_heads,
        f"{a}.attention.key_length": shape.head_dim,
        f"{a}.attention.value_length": shape.head_dim,
        f"{a}.rope.dimension_count": shape.rope_dim or shape.head_dim,
        f"{a}.rope.freq_base": float(shape.rope_base),
        f"{a}.attention.layer_norm_rms_epsilon": float(shape.norm_eps),
    }
    if shape.sliding_window:
        md[f"{a}.attention.sliding_window"] = shape.sliding_window
    if shape.pooling:
        md[f"{a}.pooling_type"] = shape.pooling
    if shape.n_experts:
        md[f"{a}.expert_count"] = shape.n_experts
        md[f"{a}.expert_used_count"] = shape.n_experts_used
        md[f"{a}.expert_feed_forward_length"] = shape.expert_ffn
    if shape.shared_expert_ffn:
        md[f"{a}.expert_shared_feed_forward_length"] = shape.shared_expert_ffn
    if shape.arch in _HYBRID:
        taps, n_k, k_dim, n_v, v_dim = shape.delta_net
        md[f"{a}.ssm.conv_kernel"] = taps
        md[f"{a}.ssm.state_size"] = k_dim
        md[f"{a}.ssm.group_count"] = n_k
        md[f"{a}.ssm.time_step_rank"] = n_v
        md[f"{a}.ssm.inner_size"] = n_v * v_dim
        md[f"{a}.full_attention_interval"] = shape.full_attention_interval
        # interleaved MRoPE's sections over the rotated pairs (text: all one position)
        pairs = (shape.rope_dim or shape.head_dim) // 2
        first = -(-pairs // 3)
        md[f"{a}.rope.dimension_sections"] = np.array(
            [first, first, pairs - 2 * first, 0], dtype=np.int32)
    if shape.yarn[0]:
        md[f"{a}.rope.scaling.type"] = "yarn"
        md[f"{a}.rope.scaling.factor"] = float(shape.yarn[0])
        md[f"{a}.rope.scaling.original_context_length"] = shape.yarn[1]
    md["general.file_type"] = file_type(quant).ftype
    md["general.quantization_version"] = 2
    return md


def write_synth(path: str | Path, shape: Shape | str, quant: str,
                tokenizer_source: GGUFFile | str | Path | None = None,
                seed: int = 0) -> dict[str, GGMLType]:
    """Write ``shape`` (a Shape or a SHAPES name) at llama.cpp file type ``quant`` to
    ``path``, with random weights and ``tokenizer_source``'s tokenizer (default
    SmolLM2's). The file appears under ``path`` only once complete (it is written
    to ``path.partial`` and renamed). Returns each tensor's type, in file order."""
    shape = shape_named(shape) if isinstance(shape, str) else shape
    file_type(quant)
    path = Path(path)
    if not isinstance(tokenizer_source, GGUFFile):
        if tokenizer_source is None:
            from ember.models.registry import DEFAULT_MODEL, ensure_model

            tokenizer_source = ensure_model(DEFAULT_MODEL)
        tokenizer_source = GGUFFile(tokenizer_source)
    metadata = model_metadata(shape, quant)
    metadata.update(tokenizer_metadata(tokenizer_source, shape.vocab))

    types: dict[str, GGMLType] = {}
    tensors = []
    for index, (name, dims) in enumerate(synth_tensors(shape)):
        t = tensor_type(name, dims, quant, n_layers=shape.n_layers, tied=shape.tied,
                        n_experts=shape.n_experts)
        types[name] = t

        def chunks(dims: tuple[int, ...] = dims, t: GGMLType = t, name: str = name,
                   index: int = index) -> Iterator[np.ndarray]:
            return _random_chunks(np.random.default_rng([seed, index]), dims, t, name)

        tensors.append(TensorToWrite(name, dims, t, chunks))

    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            write_gguf(f, metadata, tensors)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return types


def type_histogram(types: Mapping[str, GGMLType]) -> str:
    """"Q4_K: 96, Q6_K: 16+1, F32: 33": tensors per type, the token embedding and
    output head (the largest tensors) counted after a "+"."""
    layers: Counter[str] = Counter()
    heads: Counter[str] = Counter()
    for name, t in types.items():
        (heads if name in ("token_embd.weight", "output.weight") else layers)[t.name] += 1
    order = sorted(set(layers) | set(heads), key=lambda k: (k.startswith("F"), k))
    return ", ".join(f"{k}: {layers[k]}" + (f"+{heads[k]}" if heads[k] else "")
                     for k in order)


def main(shapes: list[str], quants: list[str], out_dir: Path,
         tokenizer: Path | None, seed: int, force: bool, layers: int | None = None
         ) -> list[Path]:
    """``ember bench synth``: write each shape (cut to ``layers`` if given) at each file
    type into ``out_dir`` as ``{shape}-{quant}.gguf`` (``{shape}-{layers}l-...``),
    skipping files already there unless ``force``."""
    todo = [(shape_named(s).with_layers(layers), file_type(q).name)
            for s in shapes for q in quants]
    out_dir.mkdir(parents=True, exist_ok=True)
    source = GGUFFile(tokenizer) if tokenizer is not None else None
    paths = []
    for shape, quant in todo:
        path = out_dir / f"{shape.name}-{quant}.gguf"
        paths.append(path)
        if path.exists() and not force:
            print(f"{path}: exists ({path.stat().st_size / 1e9:.2f} GB), kept "
                  "(--force writes it again)")
            continue
        start = time.perf_counter()
        types = write_synth(path, shape, quant, source, seed)
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB, {shape.description} "
              f"{quant}, {time.perf_counter() - start:.0f} s\n  {type_histogram(types)}")
        sys.stdout.flush()
    return paths
