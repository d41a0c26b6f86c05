"""A small mixture of experts trained here, for routing that real text drives.

The pilot's recall and what a cache learned from history buys are properties of
*learned* routing: a router of random weights reads a residual stream of noise (a deep
random network's, dominated by a few directions, sends most tokens to a few experts),
so it measures neither, and no real MoE small enough for these machines ships on PyPI.
(Splitting SmolLM2's dense FFNs into experts, "MoEfication", was tried and dropped: its
SiLU activations are not sparse enough — 12 of 24 experts chosen by their actual
activations still agreed with the dense model's next token only 45% of the time.)

So this trains one: a Mixtral-style llama (pre-norm blocks, adjacent-pair RoPE, GQA,
every FFN ``n_experts`` SwiGLU experts of which the router's softmax picks ``top_k``,
their weights renormalised) with SmolLM2's tokenizer and tied embeddings, on the
Python standard library's own source (code and docstrings every Python install has),
with a load-balancing loss (Switch Transformer's) so experts specialise without
collapsing. ~15 minutes on two cores (400 steps of 8 windows of 256 tokens; SmolLM2's
49k-token output layer is most of a step) give a model whose routing follows its text.

:func:`write_gguf` writes it as llama.cpp writes a Mixtral (``llama.expert_count``,
``ffn_{gate,up,down}_exps``; matrices Q8_0, norms and the router F32), so ember and
llama.cpp run it. :class:`TinyMoE` is an independent PyTorch implementation of the
same network: the tests check that ember's logits of the written file are its logits.
"""

from __future__ import annotations

import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEShape:
    n_layers: int = 6
    hidden: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    n_experts: int = 16
    top_k: int = 2
    expert_ffn: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    context: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


class TinyMoE(torch.nn.Module):
    """The network ember runs from the written file, in plain PyTorch (for training)."""

    def __init__(self, shape: MoEShape, vocab: int) -> None:
        super().__init__()
        s, d = shape, shape.head_dim
        self.shape = s
        self.embed = torch.nn.Parameter(torch.randn(vocab, s.hidden) * 0.02)
        self.layers = torch.nn.ModuleList()
        for _ in range(s.n_layers):
            layer = torch.nn.Module()
            layer.attn_norm = torch.nn.Parameter(torch.ones(s.hidden))
            layer.q = torch.nn.Parameter(torch.randn(s.n_heads * d, s.hidden) * s.hidden ** -0.5)
            layer.k = torch.nn.Parameter(torch.randn(s.n_kv_heads * d, s.hidden) * s.hidden ** -0.5)
            layer.v = torch.nn.Parameter(torch.randn(s.n_kv_heads * d, s.hidden) * s.hidden ** -0.5)
            layer.o = torch.nn.Parameter(torch.randn(s.hidden, s.n_heads * d)
                                         * (s.n_heads * d) ** -0.5 / math.sqrt(2 * s.n_layers))
            layer.ffn_norm = torch.nn.Parameter(torch.ones(s.hidden))
            layer.router = torch.nn.Parameter(torch.randn(s.n_experts, s.hidden) * 0.01)
            layer.gate = torch.nn.Parameter(torch.randn(s.n_experts, s.expert_ffn, s.hidden)
                                            * s.hidden ** -0.5)
            layer.up = torch.nn.Parameter(torch.randn(s.n_experts, s.expert_ffn, s.hidden)
                                          * s.hidden ** -0.5)
            layer.down = torch.nn.Parameter(torch.randn(s.n_experts, s.hidden, s.expert_ffn)
                                            * s.expert_ffn ** -0.5 / math.sqrt(2 * s.n_layers))
            self.layers.append(layer)
        self.out_norm = torch.nn.Parameter(torch.ones(s.hidden))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Adjacent pairs (x[2i], x[2i+1]) rotated by pos * base^(-2i/d): ggml's normal
        RoPE, the layout llama GGUFs hold Q and K in."""
        d = x.shape[-1]
        inv = self.shape.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = pos[:, None].float() * inv[None]  # [T, d/2]
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]  # [1, T, 1, d/2]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, vocab] of ids [B, T] and the load-balancing loss."""
        s, d = self.shape, self.shape.head_dim
        B, T = ids.shape
        pos = torch.arange(T)
        x = self.embed[ids]
        balance = x.new_zeros(())
        for layer in self.layers:
            h = self._norm(x, layer.attn_norm, s.norm_eps)
            q = self._rope((h @ layer.q.T).view(B, T, s.n_heads, d), pos)
            k = self._rope((h @ layer.k.T).view(B, T, s.n_kv_heads, d), pos)
            v = (h @ layer.v.T).view(B, T, s.n_kv_heads, d)
            rep = s.n_heads // s.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True)
            x = x + att.transpose(1, 2).reshape(B, T, -1) @ layer.o.T
            h = self._norm(x, layer.ffn_norm, s.norm_eps).reshape(B * T, -1)
            y, aux = self._experts(layer, h)
            x = x + y.view(B, T, -1)
            balance = balance + aux
        x = self._norm(x, self.out_norm, s.norm_eps)
        return x @ self.embed.T, balance / s.n_layers

    def _experts(self, layer: Any, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        probs = torch.softmax(h @ layer.router.T, dim=-1)  # [N, E]
        weights, chosen = probs.topk(s.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in range(s.n_experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if len(rows) == 0:
                continue
            x = h[rows]
            y = (F.silu(x @ layer.gate[e].T) * (x @ layer.up[e].T)) @ layer.down[e].T
            out.index_add_(0, rows, y * weights[rows, slot, None])
        # Switch Transformer's balance: E * sum_e (share of tokens to e) * (mean prob of e)
        share = F.one_hot(chosen, s.n_experts).float().sum(1).mean(0) / s.top_k
        return out, s.n_experts * (share * probs.mean(0)).sum()


def training_text(max_chars: int = 12_000_000) -> str:
    """The standard library's Python source (no tests), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "idlelib", "site-packages") for p in rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n\n".join(parts)


def train(tokens: list[int], vocab: int, shape: MoEShape, steps: int, batch: int = 16,
          seq: int = 256, lr: float = 3e-3, balance_weight: float = 0.01, seed: int = 0,
          log_every: int = 50) -> TinyMoE:
    """Train on random windows of ``tokens``; prints the loss every ``log_every`` steps."""
    torch.manual_seed(seed)
    model = TinyMoE(shape, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    data = torch.tensor(tokens)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(steps):
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        at = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[a:a + seq + 1] for a in at.tolist()])
        logits, balance = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), window[:, 1:].reshape(-1))
        opt.zero_grad()
        (loss + balance_weight * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  step {step:5d}  loss {loss.item():.3f}  balance {balance.item():.3f}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return model.eval()


def write_gguf(model: TinyMoE, tokenizer_source: Any, out: Path, quantize: bool = True
               ) -> Path:
    """``model`` as a Mixtral-style llama GGUF: matrices Q8_0 (``quantize``) or F32, norms
    and the router F32."""
    import gguf as gguf_py

    from ember.bench.moe_model import copy_tokenizer

    s = model.shape
    q8 = gguf_py.GGMLQuantizationType.Q8_0
    partial = out.with_name(out.name + ".partial")
    w = gguf_py.GGUFWriter(str(partial), "llama")
    w.add_name(f"ember's trained MoE ({s.n_experts} experts, {s.top_k} per token)")
    for key, value in (("block_count", s.n_layers), ("context_length", s.context),
                       ("embedding_length", s.hidden), ("feed_forward_length", s.expert_ffn),
                       ("attention.head_count", s.n_heads),
                       ("attention.head_count_kv", s.n_kv_heads),
                       ("rope.dimension_count", s.head_dim), ("expert_count", s.n_experts),
                       ("expert_used_count", s.top_k)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", s.rope_base)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", s.norm_eps)
    copy_tokenizer(w, tokenizer_source)

    def f32(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, t.detach().float().contiguous().numpy())

    def quant(name: str, t: torch.Tensor) -> None:
        if not quantize:
            return f32(name, t)
        arr = t.detach().float().contiguous().numpy()
        w.add_tensor(name, gguf_py.quants.quantize(arr, q8), raw_dtype=q8)

    quant("token_embd.weight", model.embed)
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", layer.attn_norm)
        quant(p + "attn_q.weight", layer.q)
        quant(p + "attn_k.weight", layer.k)
        quant(p + "attn_v.weight", layer.v)
        quant(p + "attn_output.weight", layer.o)
        f32(p + "ffn_norm.weight", layer.ffn_norm)
        f32(p + "ffn_gate_inp.weight", layer.router)
        quant(p + "ffn_gate_exps.weight", layer.gate)
        quant(p + "ffn_up_exps.weight", layer.up)
        quant(p + "ffn_down_exps.weight", layer.down)
    f32("output_norm.weight", model.out_norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(partial, out)
    return out


def trained_moe_path() -> Path:
    from ember.models.files import ember_home

    return ember_home() / "bench" / "trained-moe-q8.gguf"


def ensure_trained_moe(steps: int = 400, batch: int = 8) -> Path:
    """The trained model of ``ember bench moe --model trained`` (~15 minutes on two
    cores, once: SmolLM2's 49k-token output layer is most of each step)."""
    import sys

    from ember.models.gguf import GGUFFile
    from ember.models.registry import ensure_model
    from ember.tokenizer import Tokenizer

    path = trained_moe_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = GGUFFile(ensure_model("smollm2-135m"))
    tokenizer = Tokenizer.from_gguf(source)
    print(f"training {path.name} on the standard library's source ({steps} steps, once)",
          file=sys.stderr)
    tokens = tokenizer.encode(training_text())
    model = train(tokens, len(source.metadata["tokenizer.ggml.tokens"]), MoEShape(), steps,
                  batch=batch)
    return write_gguf(model, source, path)
