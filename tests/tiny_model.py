"""Tiny random-weight GGUFs (llama, qwen2, qwen3), written with ``gguf``, for fast tests.

It borrows SmolLM2's tokenizer metadata (so text round-trips like the real model)
and quantizes its matrices to Q8_0 so the loader's quantized path is exercised.
Random weights make logits noisy but well separated, which is what stream-equality
tests need; anything about output *quality* is tested on the real model instead.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from ember.bench.moe_model import copy_tokenizer as _copy_tokenizer
from ember.models.gguf import GGUFFile

# Qwen-block tiny models (NEOX RoPE; Q/K/V biases, or q/k norms and a head_dim apart
# from hidden / heads), untied heads: for the transformers oracle and the e2e tests.
TINY_QWEN: dict[str, dict[str, int]] = {"qwen2": {}, "qwen3": {"head_dim": 32}}


# Types gguf-py cannot quantize, written as random blocks: the f16 fields that scale
# a block (byte offset, and d as a fraction of the weights' wanted spread, so values
# stay about that size) — every code and sub-scale bit is random.
RANDOM_BLOCK_SCALES: dict[gguf.GGMLQuantizationType, tuple[tuple[int, float], ...]] = {
    gguf.GGMLQuantizationType.Q2_K: ((80, 1 / 20), (82, 1 / 20)),
    gguf.GGMLQuantizationType.Q3_K: ((108, 1 / 50),),
    gguf.GGMLQuantizationType.IQ4_NL: ((0, 1 / 64),),
    gguf.GGMLQuantizationType.IQ4_XS: ((0, 1 / 1000),),
    gguf.GGMLQuantizationType.IQ2_XXS: ((0, 1 / 100),),  # no dequantizer: refused at load
}


def _random_tensors(w: gguf.GGUFWriter, rng: np.random.Generator,  # noqa: ANN202
                    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0):
    """Writers of random tensors into ``w``: a ``qtype`` matrix of about N(0, scale^2)
    weights, and an f32 vector around ``center`` (norm weights by default)."""
    def q8(name: str, out_f: int, in_f: int, scale: float) -> None:
        if qtype in RANDOM_BLOCK_SCALES:
            elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, size=(out_f, in_f // elems, nbytes), dtype=np.uint8)
            for at, share in RANDOM_BLOCK_SCALES[qtype]:
                d = np.full(raw.shape[:2], scale * share, np.float16)
                raw[..., at:at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
            w.add_tensor(name, raw.reshape(out_f, -1), raw_dtype=qtype)
            return
        data = (rng.standard_normal((out_f, in_f)) * scale).astype(np.float32)
        packed = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, packed, raw_dtype=qtype)

    def f32(name: str, n: int, center: float = 1.0, spread: float = 0.1) -> None:
        w.add_tensor(name, (center + spread * rng.standard_normal(n)).astype(np.float32))

    return q8, f32


def write_tiny_llama(
    path: Path,
    tokenizer_source: GGUFFile,
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int = 128,
    context: int = 2048,
    seed: int = 0,
    arch: str = "llama",
    head_dim: int | None = None,
    rope_base: float = 10000.0,
    untied: bool = False,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
) -> Path:
    """A llama-block model; ``arch`` "qwen2" adds Q/K/V biases, "qwen3" per-head q/k
    RMSNorms (and may set ``head_dim`` apart from hidden / heads, as Qwen3 does);
    ``qtype`` is the matrices' block type."""
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer_source.metadata["tokenizer.ggml.tokens"])
    head_dim = head_dim or hidden // n_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    if head_dim != hidden // n_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    _copy_tokenizer(w, tokenizer_source)

    q8, f32 = _random_tensors(w, rng, qtype)

    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    q8("token_embd.weight", vocab, hidden, 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", hidden)
        q8(p + "attn_q.weight", q_dim, hidden, hidden**-0.5)
        q8(p + "attn_k.weight", kv_dim, hidden, hidden**-0.5)
        q8(p + "attn_v.weight", kv_dim, hidden, hidden**-0.5)
        if arch == "qwen2":
            for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                f32(p + f"attn_{x}.bias", n, 0.0, 0.5)
        if arch == "qwen3":
            f32(p + "attn_q_norm.weight", head_dim)
            f32(p + "attn_k_norm.weight", head_dim)
        q8(p + "attn_output.weight", hidden, q_dim, q_dim**-0.5)
        f32(p + "ffn_norm.weight", hidden)
        q8(p + "ffn_gate.weight", ffn, hidden, hidden**-0.5)
        q8(p + "ffn_up.weight", ffn, hidden, hidden**-0.5)
        q8(p + "ffn_down.weight", hidden, ffn, ffn**-0.5)
    f32("output_norm.weight", hidden)
    if untied:
        q8("output.weight", vocab, hidden, hidden**-0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_gemma3(path: Path, tokenizer_source: GGUFFile, *, n_layers: int = 6,
                      hidden: int = 64, n_heads: int = 4, n_kv_heads: int = 1,
                      head_dim: int = 32, ffn: int = 128, window: int = 8,
                      seed: int = 0) -> Path:
    """A Gemma 3 block model (Q8_0): sliding-window layers (a small ``window``, so short
    prompts cross it) and a global one every sixth, q/k norms, post-norms, tied head.
    Norm weights are stored as GGUF stores Gemma's: already ``1 + w``."""
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer_source.metadata["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    _copy_tokenizer(w, tokenizer_source)

    q8, norm = _random_tensors(w, rng)

    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    q8("token_embd.weight", vocab, hidden, hidden**-0.5)
    for i in range(n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", hidden)
        q8(p + "attn_q.weight", q_dim, hidden, hidden**-0.5)
        q8(p + "attn_k.weight", kv_dim, hidden, hidden**-0.5)
        q8(p + "attn_v.weight", kv_dim, hidden, hidden**-0.5)
        norm(p + "attn_q_norm.weight", head_dim)
        norm(p + "attn_k_norm.weight", head_dim)
        q8(p + "attn_output.weight", hidden, q_dim, q_dim**-0.5)
        norm(p + "post_attention_norm.weight", hidden)
        norm(p + "ffn_norm.weight", hidden)
        q8(p + "ffn_gate.weight", ffn, hidden, hidden**-0.5)
        q8(p + "ffn_up.weight", ffn, hidden, hidden**-0.5)
        q8(p + "ffn_down.weight", hidden, ffn, ffn**-0.5)
        norm(p + "post_ffw_norm.weight", hidden)
    norm("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
