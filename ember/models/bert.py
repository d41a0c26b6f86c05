"""BERT encoders: embedding models, not decoders. Two families share this module as
llama.cpp's one BERT graph does:

- ``bert`` (bge, all-MiniLM, mxbai-embed...): learned absolute position embeddings,
  projections with biases, an FFN of one up projection, exact (erf) GELU, one down
  projection;
- ``nomic-bert`` (nomic-embed-text): no position table but NEOX rotary positions on q
  and k, one fused q|k|v projection (``attn_qkv``), no biases, a SwiGLU FFN
  (SiLU(gate) * up).

What both differ in from the shared decoder: every token attends to every token of its
input (no causal mask, no KV cache: an input is run whole, in one pass); a token-type
embedding (type 0, as llama.cpp feeds it) is added to the token's; LayerNorm with a bias
after each sublayer (post-norm) and after the embeddings, instead of RMSNorm before.
There is no output head: what an embedding pools is the last layer's output
(:mod:`ember.engine.embedding`). It generates nothing, and the engine refuses generation
requests for it by name. Which variant a file is follows from its tensors (a position
table or not, a fused qkv or not, a gate or not), so a file mixing them is read as
written.

Weights are held dense in float32 (a BERT is a few hundred MB at most); the matmuls run
through PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.kv.blocks import KVStorage
from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile
from ember.models.layers.attention import AttentionBatch
from ember.models.layers.rope import RotaryEmbedding
from ember.models.linear import load_dense
from ember.models.rank_head import RankHead, load_rank_head

_OPTIONAL = ("token_types.weight", "position_embd.weight")
_LAYER = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_output_norm",
          "ffn_up", "ffn_gate", "ffn_down", "layer_output_norm")


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    """``causal`` from ``bert.attention.causal`` (false in every BERT file)."""
    return {"causal": bool(gguf.get(f"{base.architecture}.attention.causal", False)),
            "tied_embeddings": True}


class BertModel:
    """A BERT encoder as its GGUF describes it (see module doc)."""

    experts = None  # what the engine reads of a decoder
    native = None
    batch_invariant = False

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                 classifier: RankHead | None = None) -> None:
        self.cfg = cfg
        self.t = tensors
        self.classifier = classifier  # a cross-encoder reranker's head
        # without a learned position table the positions are rotary (nomic-bert)
        self.rope = None if "position_embd.weight" in tensors else RotaryEmbedding(
            cfg.rope_dim, cfg.rope_base, neox=True)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, cfg: ModelConfig, fmt: Any, moe: Any = None
                  ) -> BertModel:
        names = ["token_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias"]
        names += [n for n in _OPTIONAL if n in gguf.tensors]
        for i in range(cfg.n_layers):
            names += [f"blk.{i}.{part}.{kind}" for part in _LAYER for kind in ("weight", "bias")
                      if f"blk.{i}.{part}.{kind}" in gguf.tensors]
        return cls(cfg, {n: load_dense(gguf, n).float() for n in names},
                   load_rank_head(gguf))

    def footprint_parts(self) -> dict[str, int]:
        """Bytes by part, as :mod:`ember.models.footprint` counts a decoder's."""
        table = self.t["token_embd.weight"].nbytes
        step = sum(x.nbytes for x in self.t.values()) - table
        return {"step": step, "embedding": table, "experts": 0, "routed": 0}

    def new_kv_storage(self, num_blocks: int, block_size: int, dtype: Any = "f32",
                       num_seqs: int = 1, num_snapshots: int = 0) -> KVStorage:
        """A token pool the engine sizes as for any model (an encoder keeps no KV: it
        is never written)."""
        c = self.cfg
        return KVStorage(c.n_layers, 1, block_size, c.n_kv_heads, c.head_dim, dtype)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("a BERT encoder does not generate")

    @torch.inference_mode()
    def hidden_states(self, tokens: torch.Tensor, batch: AttentionBatch, kv: Any = None
                      ) -> torch.Tensor:
        """The last layer's output for every token (T, hidden); each row of ``batch``
        is one whole input (its tokens attend to each other only)."""
        lengths = []
        for row in batch.rows:
            if row.start:
                raise ValueError("a BERT encoder runs each input whole")
            lengths.append(row.q_len)
        t, c = self.t, self.cfg
        positions = torch.cat([torch.arange(n) for n in lengths])
        x = t["token_embd.weight"][tokens]
        rotation = None
        if self.rope is None:
            x = x + t["position_embd.weight"][positions]
        else:
            rotation = self.rope.rotation(positions)
        if "token_types.weight" in t:
            x = x + t["token_types.weight"][0]
        x = self._norm(x, "token_embd_norm", c.norm_eps)
        for i in range(c.n_layers):
            x = self._layer(x, i, lengths, rotation)
        return x

    def _layer(self, x: torch.Tensor, i: int, lengths: list[int],
               rotation: torch.Tensor | None) -> torch.Tensor:
        c, p = self.cfg, f"blk.{i}."
        q, k, v = self._qkv(x, p)
        if rotation is not None:
            assert self.rope is not None
            q, k = (self.rope.apply(z.view(len(z), -1, c.head_dim), rotation).flatten(1)
                    for z in (q, k))
        out = torch.empty_like(q)
        first = 0
        for n in lengths:  # every token of an input sees every other, no other input's
            rows = slice(first, first + n)
            heads = [z[rows].view(n, c.n_heads, c.head_dim).transpose(0, 1)
                     for z in (q, k, v)]
            attended = torch.nn.functional.scaled_dot_product_attention(*heads)
            out[rows] = attended.transpose(0, 1).reshape(n, -1)
            first += n
        x = self._norm(x + self._linear(out, p + "attn_output"), p + "attn_output_norm",
                       c.norm_eps)
        up = self._linear(x, p + "ffn_up")
        if p + "ffn_gate.weight" in self.t:  # SwiGLU
            ffn = torch.nn.functional.silu(self._linear(x, p + "ffn_gate")) * up
        else:
            ffn = torch.nn.functional.gelu(up)
        return self._norm(x + self._linear(ffn, p + "ffn_down"), p + "layer_output_norm",
                          c.norm_eps)

    def _qkv(self, x: torch.Tensor, p: str) -> tuple[torch.Tensor, ...]:
        if p + "attn_qkv.weight" not in self.t:
            return tuple(self._linear(x, p + name) for name in ("attn_q", "attn_k", "attn_v"))
        width = self.cfg.n_heads * self.cfg.head_dim
        kv_width = self.cfg.n_kv_heads * self.cfg.head_dim
        return self._linear(x, p + "attn_qkv").split([width, kv_width, kv_width], dim=-1)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.t[name + ".weight"],
                                          self.t.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.t[name + ".weight"],
                                              self.t[name + ".bias"], eps)
