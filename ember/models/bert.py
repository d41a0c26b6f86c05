"""BERT encoders (``general.architecture`` ``bert``: bge, all-MiniLM, mxbai-embed...):
an embedding model, not a decoder.

What differs from the shared decoder: every token attends to every token of its input
(no causal mask, no KV cache: an input is run whole, in one pass); learned absolute
position embeddings and a token-type embedding are added to the token's; LayerNorm
with a bias after each sublayer (post-norm) and after the embeddings, instead of
RMSNorm before; projections with biases; an FFN of one up projection, exact (erf)
GELU, one down projection. There is no output head: what an embedding pools is the last
layer's output (:mod:`ember.engine.embedding`). It generates nothing, and the engine
refuses generation requests for it by name.

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
from ember.models.linear import load_dense


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    """``causal`` from ``bert.attention.causal`` (false in every BERT file)."""
    return {"causal": bool(gguf.get(f"{base.architecture}.attention.causal", False)),
            "tied_embeddings": True}


class BertModel:
    """A BERT encoder as its GGUF describes it (see module doc)."""

    experts = None  # what the engine reads of a decoder
    native = None
    classifier = None
    batch_invariant = False

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.t = tensors

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, cfg: ModelConfig, fmt: Any, moe: Any = None
                  ) -> BertModel:
        names = ["token_embd.weight", "position_embd.weight", "token_embd_norm.weight",
                 "token_embd_norm.bias"]
        if "token_types.weight" in gguf.tensors:
            names.append("token_types.weight")
        for i in range(cfg.n_layers):
            for part in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_output_norm",
                         "ffn_up", "ffn_down", "layer_output_norm"):
                names += [f"blk.{i}.{part}.weight", f"blk.{i}.{part}.bias"]
        return cls(cfg, {n: load_dense(gguf, n).float() for n in names})

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
        x = t["token_embd.weight"][tokens] + t["position_embd.weight"][positions]
        if "token_types.weight" in t:
            x = x + t["token_types.weight"][0]
        x = self._norm(x, "token_embd_norm", c.norm_eps)
        for i in range(c.n_layers):
            x = self._layer(x, i, lengths)
        return x

    def _layer(self, x: torch.Tensor, i: int, lengths: list[int]) -> torch.Tensor:
        c, p = self.cfg, f"blk.{i}."
        q, k, v = (self._linear(x, p + name) for name in ("attn_q", "attn_k", "attn_v"))
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
        ffn = torch.nn.functional.gelu(self._linear(x, p + "ffn_up"))
        return self._norm(x + self._linear(ffn, p + "ffn_down"), p + "layer_output_norm",
                          c.norm_eps)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.t[name + ".weight"], self.t[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.t[name + ".weight"],
                                              self.t[name + ".bias"], eps)
