"""Llama-family decoder (Llama 2/3, SmolLM, Mistral-style dense models) from GGUF.

Pre-norm blocks: RMSNorm → attention (GQA, RoPE) → residual → RMSNorm → SwiGLU →
residual; final RMSNorm and an output head that may be tied to the embeddings.

RoPE layout: llama.cpp's converter permutes the Q/K rows of HF checkpoints so that
a GGUF llama rotates *adjacent* pairs (x[2i], x[2i+1]) — ggml's "normal" rope —
rather than HF's split halves. Applying HF's layout here would silently scramble
attention, so the transformers oracle test guards it.

The model knows nothing about requests: it maps a flat batch of token ids plus an
:class:`AttentionBatch` to logits for the rows asked for, reading and writing K/V
in the pool it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ember.kv.blocks import KVStorage
from ember.models.attention import AttentionBatch, paged_attention
from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile
from ember.models.linear import Embedding, Linear, QuantLinear, WeightFormat, load_dense

log = logging.getLogger(__name__)


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    qkv: Linear  # fused attn_q | attn_k | attn_v
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear  # fused ffn_gate | ffn_up
    down: Linear


class RotaryEmbedding:
    """Adjacent-pair RoPE over the first ``rope_dim`` head dims, as complex rotations.

    Each pair (x[2i], x[2i+1]) is a complex number multiplied by e^(i·pos·θ_i): one
    complex multiply per call instead of a dozen real ops, and the per-position
    rotations are looked up once per forward pass (``rotation``), not once per layer.
    """

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> None:
        half = cfg.rope_dim // 2
        inv_freq = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.rope_dim)
        if freq_factors is not None:  # llama3-style long-context scaling (rope_freqs.weight)
            inv_freq = inv_freq / freq_factors.double()
        self.inv_freq = inv_freq
        self.rope_dim = cfg.rope_dim
        self._table = torch.empty(0, half, dtype=torch.complex64)

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """e^(i·pos·θ) for each position: complex (T, 1, rope_dim/2), broadcast over heads."""
        if positions.numel() and int(positions.max()) >= self._table.shape[0]:
            n = max(int(positions.max()) + 1, 2 * self._table.shape[0], 256)
            angles = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            self._table = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
        return self._table[positions][:, None, :]

    def apply(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (T, heads, head_dim) by ``rotation`` from ``rotation()``."""
        d = self.rope_dim
        head = x if d == x.shape[-1] else x[..., :d].contiguous()
        rotated = torch.view_as_real(torch.view_as_complex(head.unflatten(-1, (-1, 2)))
                                     * rotation).flatten(-2)
        return rotated if d == x.shape[-1] else torch.cat((rotated, x[..., d:]), dim=-1)


def native_decoder(cfg: ModelConfig, layers: list[LlamaLayer], ext: Any = None) -> Any | None:
    """The layers as one native ``DecoderStack`` (ember/kernels/fused_decoder.h) when
    every projection is a packed quantized matrix and the kernel is built; else None.
    ``ext``: the compiled extension to build it with (default: this machine's)."""
    linears = [[layer.qkv, layer.o, layer.gate_up, layer.down] for layer in layers]
    if not layers or not all(isinstance(p, QuantLinear) for ps in linears for p in ps):
        return None
    from ember import kernels

    ext = ext or kernels.quant_matmul()
    if ext is None or (cfg.head_dim % 8 and ext.simd() != "scalar"):
        return None
    stack = ext.DecoderStack(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             cfg.rope_dim, cfg.ffn_size, cfg.norm_eps)
    for layer, parts in zip(layers, linears, strict=True):
        stack.add_layer(layer.attn_norm, layer.ffn_norm, *(p.packed_form() for p in parts))
    return stack


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: Embedding,
        layers: list[LlamaLayer],
        output_norm: torch.Tensor,
        output: Linear,
        rope: RotaryEmbedding,
        norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        # RMSNorm(x, weight, eps); the weight format may bring a faster kernel for it
        self.norm = norm or (lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps))
        self.embed = embed
        self.layers = layers
        self.output_norm = output_norm
        self.output = output
        self.rope = rope
        # The whole stack in one native call per step, where the weights allow it
        # (quantized layers); None: the op-by-op PyTorch path below, the oracle.
        self.native = native_decoder(cfg, layers)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, cfg: ModelConfig, fmt: WeightFormat) -> LlamaModel:
        layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            layers.append(
                LlamaLayer(
                    attn_norm=load_dense(gguf, p + "attn_norm.weight"),
                    qkv=fmt.linear(gguf, [p + "attn_q.weight", p + "attn_k.weight",
                                          p + "attn_v.weight"]),
                    o=fmt.linear(gguf, [p + "attn_output.weight"]),
                    ffn_norm=load_dense(gguf, p + "ffn_norm.weight"),
                    gate_up=fmt.linear(gguf, [p + "ffn_gate.weight", p + "ffn_up.weight"]),
                    down=fmt.linear(gguf, [p + "ffn_down.weight"]),
                )
            )
            # the layer is in its own tensors now: its file pages need not stay resident
            # (loading then never holds the whole file and every packed copy at once)
            gguf.release_pages()
        embed = fmt.embedding(gguf, "token_embd.weight")
        tied = embed.tied_linear() if cfg.tied_embeddings else None
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        output = tied or fmt.linear(gguf, [head_name])  # a tied dense head shares storage
        freq_factors = (
            load_dense(gguf, "rope_freqs.weight") if "rope_freqs.weight" in gguf.tensors else None
        )
        model = cls(cfg, embed, layers, load_dense(gguf, "output_norm.weight"), output,
                    RotaryEmbedding(cfg, freq_factors), fmt.rms_norm)
        if fmt.name == "q4" and not model.batch_invariant:
            log.warning("%s: not every projection and the output head are packed 4/8-bit "
                        "here, so q4 runs (partly) op by op and a request's logits may "
                        "differ slightly with the batch (tokens only at near-ties)",
                        gguf.path.name)
        return model

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits are bitwise independent of the rest of the batch: the
        native stack runs every layer and the head is a packed matrix (per-row kernel)."""
        return self.native is not None and isinstance(self.output, QuantLinear)

    def new_kv_storage(self, num_blocks: int, block_size: int,
                       dtype: torch.dtype = torch.float32) -> KVStorage:
        c = self.cfg
        return KVStorage(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, dtype)

    def score(self, token_ids: list[int], block_size: int = 16,
              kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Logits at every position of one sequence (teacher forcing), shape (T, vocab).

        Uses a private KV pool (of ``kv_dtype``); meant for evaluation and tests.
        """
        from ember.kv.blocks import BlockAllocator, BlockTable
        from ember.models.attention import RowSpec

        n = len(token_ids)
        n_blocks = -(-n // block_size)
        table = BlockTable(BlockAllocator(n_blocks), block_size)
        table.reserve(n)
        batch = AttentionBatch.build([RowSpec(table.block_ids(n), 0, n)], block_size)
        kv = self.new_kv_storage(n_blocks, block_size, kv_dtype)
        kv.zero_blocks(table.allocator.take_fresh())
        return self.forward(torch.tensor(token_ids), batch, kv, torch.arange(n))

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        batch: AttentionBatch,
        kv: KVStorage,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` (T,) through the model, writing their K/V into ``kv``.

        Returns float32 logits for the flat positions in ``logits_index`` (default: the
        last token of every row), shape (len(logits_index), vocab).
        """
        c = self.cfg
        x = self.decode_layers(self.embed(tokens), batch, kv)
        rows = x[batch.row_ends if logits_index is None else logits_index]
        return self.output(self.norm(rows, self.output_norm, c.norm_eps))

    @torch.inference_mode()
    def decode_layers(self, x: torch.Tensor, batch: AttentionBatch, kv: KVStorage) -> torch.Tensor:
        """The residual stream (T, hidden) after every layer, from the embeddings ``x``."""
        c = self.cfg
        if self.native is not None:
            x = x.clone(memory_format=torch.contiguous_format)  # updated in place
            rope = torch.view_as_real(self.rope.rotation(batch.positions)).contiguous()
            self.native.forward(x, kv.pool, rope, batch.slot_mapping, batch.tables,
                                batch.token_rows, batch.positions)
            return x
        n = x.shape[0]
        q_dim, kv_dim = c.n_heads * c.head_dim, c.kv_dim
        qk_heads = c.n_heads + c.n_kv_heads
        rotation = self.rope.rotation(batch.positions)
        slot_blocks = batch.slot_mapping // batch.block_size
        slot_offsets = batch.slot_mapping % batch.block_size
        for i, layer in enumerate(self.layers):
            h = self.norm(x, layer.attn_norm, c.norm_eps)
            qkv = layer.qkv(h)
            # q and k share head_dim: rotate them together in one call
            qk = self.rope.apply(qkv[:, : q_dim + kv_dim].view(n, qk_heads, c.head_dim), rotation)
            q, k = qk[:, : c.n_heads], qk[:, c.n_heads :]
            v = qkv[:, q_dim + kv_dim :]
            kv.write(i, slot_blocks, slot_offsets, k, v.view(n, c.n_kv_heads, c.head_dim))
            attn = paged_attention(q, kv.k[i], kv.v[i], batch)
            x = x + layer.o(attn.reshape(n, q_dim))
            h = self.norm(x, layer.ffn_norm, c.norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return x
