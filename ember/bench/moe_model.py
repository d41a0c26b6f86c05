"""A random-weight Qwen3-MoE GGUF, written with the ``gguf`` package.

``ember bench moe`` needs a mixture-of-experts model whose experts outweigh a small
cache (no real one is small enough to ship), and the tests need a tiny one; both are
written here. Weights are random (routing is roughly uniform over experts), the
tokenizer is borrowed from another GGUF (SmolLM2's), so text round-trips.
``gguf`` is imported when called: it is a test/bench dependency, not a runtime one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ember.models.gguf import GGUFFile


def write_moe_gguf(
    path: Path,
    tokenizer_source: GGUFFile,
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    n_experts: int = 8,
    n_used: int = 2,
    expert_ffn: int = 64,
    seed: int = 0,
    expert_type: str = "Q8_0",
    branch_scale: float = 1.0,
    split_max_tensors: int = 0,
) -> Path:
    """A Qwen3-MoE model: Qwen3 attention, every FFN a router over ``n_experts``
    SwiGLU experts stored as 3-D [E, out, in] tensors (``expert_type``).

    ``branch_scale`` multiplies what attention and the experts add to the residual
    stream (their output projections): small, a layer's router reads nearly the state
    the previous layer read, a model whose next-layer routing is predictable from the
    current state (the pilot's tests); large, it is not. ``split_max_tensors``: write a
    split model, parts of at most that many tensors, by gguf-py's writer (llama.cpp's
    own, as ``convert_hf_to_gguf.py --split-max-tensors``); returns its first part."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab = len(tokenizer_source.metadata["tokenizer.ggml.tokens"])
    qtype = gguf.GGMLQuantizationType[expert_type]
    w = gguf.GGUFWriter(str(path), "qwen3moe", split_max_tensors=split_max_tensors)
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(expert_ffn)
    w.add_expert_feed_forward_length(expert_ffn)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(n_used)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    copy_tokenizer(w, tokenizer_source)

    def quant(name: str, data: np.ndarray, t: Any) -> None:
        if t in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data.astype(np.float32 if t == gguf.GGMLQuantizationType.F32
                                           else np.float16))
            return
        w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)

    def f32(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q8 = gguf.GGMLQuantizationType.Q8_0
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    quant("token_embd.weight", (rng.standard_normal((vocab, hidden))).astype(np.float32), q8)
    for i in range(n_layers):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", hidden)
        quant(p + "attn_q.weight", matrix(q_dim, hidden), q8)
        quant(p + "attn_k.weight", matrix(kv_dim, hidden), q8)
        quant(p + "attn_v.weight", matrix(kv_dim, hidden), q8)
        f32(p + "attn_q_norm.weight", head_dim)
        f32(p + "attn_k_norm.weight", head_dim)
        quant(p + "attn_output.weight", matrix(hidden, q_dim) * branch_scale, q8)
        f32(p + "ffn_norm.weight", hidden)
        w.add_tensor(p + "ffn_gate_inp.weight", matrix(n_experts, hidden) * 4)
        quant(p + "ffn_gate_exps.weight", matrix(n_experts, expert_ffn, hidden), qtype)
        quant(p + "ffn_up_exps.weight", matrix(n_experts, expert_ffn, hidden), qtype)
        quant(p + "ffn_down_exps.weight",
              matrix(n_experts, hidden, expert_ffn) * branch_scale, qtype)
    f32("output_norm.weight", hidden)
    quant("output.weight", matrix(vocab, hidden), q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        parts = sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))
        assert len(parts) == 1, parts
        return parts[0]
    return path


def copy_tokenizer(w: Any, src: GGUFFile) -> None:
    """SmolLM2's (or any BPE GGUF's) vocabulary, merges and template into ``w``."""
    md = src.metadata
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types([int(t) for t in md["tokenizer.ggml.token_type"]])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(int(md["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(md["tokenizer.ggml.eos_token_id"]))
    w.add_add_bos_token(bool(md.get("tokenizer.ggml.add_bos_token", False)))
    if "tokenizer.chat_template" in md:
        w.add_chat_template(md["tokenizer.chat_template"])
