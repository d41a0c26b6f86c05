"""Weight bytes (ember.models.footprint) against the GGUF's own tensor sizes, and the
engine's startup memory line."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ember.models.footprint import step_weight_bytes, weight_bytes
from ember.models.gguf import GGUFFile


def f32_bytes(gguf: GGUFFile, names) -> int:
    return sum(4 * gguf.tensor(n).n_elements for n in names)


def test_f32_weights_hold_every_tensor_once_a_tied_table_once(tiny_gguf: Path, tiny_loaded):
    """The tiny model ties its head to the embedding: the table is held once."""
    gguf = GGUFFile(tiny_gguf)
    assert "output.weight" not in gguf.tensors
    assert weight_bytes(tiny_loaded.model) == f32_bytes(gguf, gguf.tensors)
    assert step_weight_bytes(tiny_loaded.model) == f32_bytes(gguf, gguf.tensors)


def test_an_untied_table_is_held_but_not_read_by_a_step(tiny_qwen_ggufs):
    """Qwen 2's tiny model: its own head, the embedding table apart, Q/K/V biases."""
    from ember.models.loader import load_model

    path = tiny_qwen_ggufs["qwen2"]
    gguf, model = GGUFFile(path), load_model(str(path), "f32").model
    assert "output.weight" in gguf.tensors and "blk.0.attn_q.bias" in gguf.tensors
    assert weight_bytes(model) == f32_bytes(gguf, gguf.tensors)
    assert step_weight_bytes(model) == f32_bytes(
        gguf, [n for n in gguf.tensors if n != "token_embd.weight"])


def test_the_engine_logs_its_memory_once_at_startup(make_tiny_engine, tiny_loaded, caplog):
    with caplog.at_level(logging.INFO, logger="ember.engine"):
        engine = make_tiny_engine(num_kv_blocks=64, block_size=16, kv_dtype="bf16")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:")]
    assert len(lines) == 1, lines
    m = re.fullmatch(r"memory: weights ([\d.]+) MB, KV pool up to ([\d.]+) MiB \(([\d.]+) "
                     r"KiB/token, bf16\), runtime ([\d.-]+) MB \(process RSS ([\d.]+) MB\)",
                     lines[0])
    assert m is not None, lines[0]
    weights, pool, per_token, runtime, rss = map(float, m.groups())
    assert weights == round(weight_bytes(tiny_loaded.model) / 1e6, 1)
    cfg = tiny_loaded.config  # 2 layers, K and V, 2 KV heads of 16 values, 2 bytes each
    token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
    assert per_token == round(token / 1024, 1)
    assert pool == round(64 * 16 * token / 2**20, 1)
    assert engine.runner.kv.pool.nbytes == 64 * 16 * token
    assert abs(runtime - (rss - weights)) <= 0.11


def test_a_decode_step_reads_the_k_experts_a_token_routes_to(tiny_moe_gguf):
    """Qwen3-MoE (f32): a step reads every dense tensor, each layer's router, and k of
    its E experts (each expert's gate, up and down), not the whole stack."""
    from ember.models.loader import load_model

    gguf, loaded = GGUFFile(tiny_moe_gguf), load_model(str(tiny_moe_gguf), "f32")
    cfg = loaded.config
    dense = [n for n in gguf.tensors if n != "token_embd.weight" and "_exps." not in n]
    per_expert = sum(gguf.tensor(f"blk.0.ffn_{x}_exps.weight").n_elements
                     for x in ("gate", "up", "down")) // cfg.n_experts * 4
    assert step_weight_bytes(loaded.model) == (
        f32_bytes(gguf, dense) + cfg.n_layers * cfg.n_experts_used * per_expert)
    assert weight_bytes(loaded.model) == f32_bytes(gguf, gguf.tensors)
