"""The decoder-only transformer every family shares, and its building blocks.

A block is: norm → attention (GQA over the paged KV, RoPE) → [post-norm] → residual
→ norm → gated MLP (act(gate) · up → down) → [post-norm] → residual; then a final
norm and an output head that may be tied to the embeddings. The families differ
only in what :class:`~ember.models.config.ModelConfig` says (RoPE layout, per-layer
sliding windows and RoPE bases, q/k norms, post-norms, biases, activation, scales)
and in how their ``configure`` hook reads that from the GGUF
(:mod:`ember.models.architectures` has the table).

The blocks themselves are in :mod:`ember.models.layers`.

The model knows nothing about requests: it maps a flat batch of token ids plus an
:class:`AttentionBatch` to logits for the rows asked for, reading and writing K/V
in the pool it is given.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ember import kernels
from ember.errors import UnsupportedModelError
from ember.kv.blocks import BlockAllocator, BlockTable, KVStorage, blocks_for
from ember.kv.dtypes import KVDtype
from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile
from ember.models.layers.attention import AttentionBatch, RowSpec, paged_attention
from ember.models.layers.mlp import GLUS, gated_mlp
from ember.models.layers.norm import Norm, norm_for, rms_norm
from ember.models.layers.rope import (
    RopeKey,
    RotaryEmbedding,
    attention_temperature,
    rope_key,
    rope_keys,
)
from ember.models.linear import (
    PACKED_TYPES,
    Embedding,
    Linear,
    QuantLinear,
    WeightArena,
    WeightFormat,
    load_dense,
)
from ember.models.moe import (
    ExpertBiases,
    ExpertStore,
    MoEFeedForward,
    MoEOptions,
    ResidentExperts,
    SharedExpert,
    StreamedExperts,
    expert_slices,
    native_experts,
)
from ember.models.rank_head import RankHead, load_rank_head

log = logging.getLogger(__name__)

# Tokens per call of the fused stack (llama.cpp's default micro-batch is the same): a
# 2,048-token step in one call held ~230 MB more at peak on a 1B model than in 512s,
# and a 512-token slice is long enough that re-reading the weights per slice is ~1%
# of its arithmetic.
NATIVE_SLICE_TOKENS = 512


@dataclass
class DecoderLayer:
    attn_norm: torch.Tensor | None  # None: no pre-norms (OLMo 2)
    qkv: Linear  # fused attn_q | attn_k | attn_v
    o: Linear
    ffn_norm: torch.Tensor | None
    gate_up: Linear | None  # fused ffn_gate | ffn_up (None: routed experts instead)
    down: Linear | None
    moe: MoEFeedForward | None = None
    qkv_bias: torch.Tensor | None = None  # q | k | v biases (Qwen2)
    q_norm: torch.Tensor | None = None  # RMSNorm weights per head (Qwen3) or of all (OLMo 2)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # Gemma's norms of each sublayer's output
    post_ffn_norm: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None  # the attention output's bias (gpt-oss)
    sinks: torch.Tensor | None = None  # per-head logits joining the softmax (gpt-oss)


def native_stack_supports(cfg: ModelConfig) -> bool:
    """Whether ``ember/kernels/fused_decoder.h`` implements this configuration: every
    option of the shared block (llama, Qwen 2/3, Gemma 3), routed experts (Qwen3-MoE,
    gpt-oss with its sinks, output bias and OpenAI's SwiGLU), and Qwen 3.5's hybrid of
    Gated DeltaNet layers and gated attention."""
    return cfg.activation in ("silu", "gelu_tanh", "swiglu_oai")


def _projections(cfg: ModelConfig, i: int, layer: Any) -> list[Linear]:
    """Layer ``i``'s matrices the stack multiplies: its mixer's (attention's qkv and o,
    or a recurrent layer's in_proj and out) and its dense FFN's."""
    mixer = [layer.in_proj, layer.out] if cfg.is_recurrent(i) else [layer.qkv, layer.o]
    return mixer + ([] if layer.moe else [layer.gate_up, layer.down])


def native_decoder(cfg: ModelConfig, layers: list[Any], ext: Any = None) -> Any | None:
    """The layers as one native ``DecoderStack`` (ember/kernels/fused_decoder.h) when
    the stack implements the configuration, every projection (every expert too) is a
    packed quantized matrix and the kernel is built; else None. ``ext``: the compiled
    extension to build it with (default: this machine's). ``layers``: DecoderLayers,
    and Qwen 3.5's DeltaNetLayers where ``cfg.recurrent_layers`` says."""
    if not layers or not native_stack_supports(cfg):
        return None
    linears = [_projections(cfg, i, layer) for i, layer in enumerate(layers)]
    if not all(isinstance(p, QuantLinear) for ps in linears for p in ps) or not all(
            layer.moe.native_ready for layer in layers if layer.moe is not None):
        return None
    ext = ext or kernels.quant_matmul()
    if ext is None or (cfg.head_dim % 8 and ext.simd() != "scalar"):
        return None
    # a stack of routed layers only: its dense FFN scratch is the experts' width
    ffn = cfg.expert_ffn_size if cfg.n_experts else cfg.ffn_size
    stack = ext.DecoderStack(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             cfg.rope_dim, ffn, cfg.norm_eps, cfg.rope_neox,
                             cfg.activation, cfg.softmax_scale)
    stack.set_block_options(cfg.pre_norms, cfg.qk_norm_full, cfg.residual_scale,
                            cfg.attn_softcap)
    stack.set_attn_output_gate(cfg.attn_output_gate)
    if cfg.attn_temperature_scale:
        stack.set_attn_temperature(cfg.attn_temperature_scale, cfg.attn_temperature_floor)
    ropes = rope_keys(cfg)
    none = torch.empty(0)
    for i, (layer, parts) in enumerate(zip(layers, linears, strict=True)):
        # the stack's own handles on the packed bytes (shared, not copied): ``ext`` may
        # be another build of the kernels than the one that packed them
        packed = [ext.PackedLinear(p.in_features, p.packed.segments) for p in parts]
        ffn_parts = packed[2:] if layer.moe is None else [None, None]
        if cfg.is_recurrent(i):
            stack.add_delta_net_layer(layer.attn_norm, layer.ffn_norm,
                                      layer.native_mixer(ext, *packed[:2], cfg), *ffn_parts)
        else:
            stack.add_layer(none if layer.attn_norm is None else layer.attn_norm,
                            none if layer.ffn_norm is None else layer.ffn_norm,
                            *packed[:2], *ffn_parts)
        if layer.moe is not None:
            stack.set_experts(native_experts(ext, layer.moe, cfg.expert_ffn_size,
                                             cfg.activation))
        if cfg.is_recurrent(i):
            continue
        if layer.o_bias is not None or layer.sinks is not None:
            stack.set_attention_extras(none if layer.o_bias is None else layer.o_bias,
                                       none if layer.sinks is None else layer.sinks)
        kind = cfg.layer_attention(i)
        stack.set_attention(kind.window or 0, ropes.index(rope_key(kind)))
        if layer.post_attn_norm is not None and layer.post_ffn_norm is not None:
            stack.set_post_norms(layer.post_attn_norm, layer.post_ffn_norm)
        if layer.qkv_bias is not None:
            stack.set_qkv_bias(layer.qkv_bias)
        if layer.q_norm is not None and layer.k_norm is not None:
            stack.set_qk_norm(layer.q_norm, layer.k_norm)
    return stack


def _names(gguf: GGUFFile, prefix: str, fused: str) -> list[str]:
    """The tensors of a fused projection: one tensor where the converter fused them
    (Phi 3's ``attn_qkv``, its ``ffn_up`` holding gate and up), else the parts in order."""
    if fused == "attn_qkv":
        if prefix + "attn_qkv.weight" in gguf.tensors:
            return [prefix + "attn_qkv.weight"]
        return [prefix + f"attn_{x}.weight" for x in "qkv"]
    if prefix + "ffn_gate.weight" not in gguf.tensors:
        return [prefix + "ffn_up.weight"]  # [gate; up] rows (checked by the caller)
    return [prefix + "ffn_gate.weight", prefix + "ffn_up.weight"]


def _optional(gguf: GGUFFile, name: str, wanted: bool) -> torch.Tensor | None:
    if not wanted:
        return None
    return load_dense(gguf, name)


def load_ffn(gguf: GGUFFile, cfg: ModelConfig, fmt: WeightFormat, i: int,
             experts: ExpertStore | None = None, moe_top_p: float = 1.0
             ) -> tuple[Linear | None, Linear | None, MoEFeedForward | None]:
    """Layer ``i``'s feed-forward part: ``(gate_up, down, None)``, or ``(None, None,
    moe)`` routed over ``experts`` in a mixture-of-experts model (``moe_top_p`` < 1:
    each token's experts cut at that cumulative weight, lossy)."""
    p = f"blk.{i}."
    if experts is None:
        gate_up = fmt.linear(gguf, _names(gguf, p, "ffn_gate_up"))
        if gate_up.out_features != 2 * cfg.ffn_size:
            raise UnsupportedModelError(
                f"{gguf.path.name}: layer {i}'s MLP has no gate ({p}ffn_gate.weight is "
                f"missing and {p}ffn_up.weight is not gate and up fused)")
        return gate_up, fmt.linear(gguf, [p + "ffn_down.weight"]), None
    biases = shared = None
    if cfg.expert_biases:
        biases = ExpertBiases(
            load_dense(gguf, p + "ffn_gate_inp.bias"),
            torch.cat([load_dense(gguf, p + f"ffn_{x}_exps.bias") for x in ("gate", "up")],
                      dim=-1),
            load_dense(gguf, p + "ffn_down_exps.bias"))
    if cfg.shared_expert_ffn_size:
        shared = SharedExpert(
            fmt.linear(gguf, [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"]),
            fmt.linear(gguf, [p + "ffn_down_shexp.weight"]),
            load_dense(gguf, p + "ffn_gate_inp_shexp.weight").reshape(-1))
    return None, None, MoEFeedForward(load_dense(gguf, p + "ffn_gate_inp.weight"), experts,
                                      i, cfg.n_experts_used, GLUS[cfg.activation], biases,
                                      shared, moe_top_p)


def load_layer(gguf: GGUFFile, cfg: ModelConfig, fmt: WeightFormat, i: int,
               experts: ExpertStore | None = None, moe_top_p: float = 1.0) -> DecoderLayer:
    """Layer ``i``'s weights, with the optional tensors the configuration asks for
    (its FFN routed over ``experts`` in a mixture-of-experts model)."""
    p = f"blk.{i}."
    bias = None
    if cfg.qkv_bias:
        bias = torch.cat([load_dense(gguf, p + f"attn_{x}.bias") for x in "qkv"])
    gate_up, down, moe = load_ffn(gguf, cfg, fmt, i, experts, moe_top_p)
    return DecoderLayer(
        attn_norm=_optional(gguf, p + "attn_norm.weight", cfg.pre_norms),
        qkv=fmt.linear(gguf, _names(gguf, p, "attn_qkv")),
        o=fmt.linear(gguf, [p + "attn_output.weight"]),
        ffn_norm=_optional(gguf, p + f"{cfg.ffn_norm_tensor}.weight", cfg.pre_norms),
        gate_up=gate_up,
        down=down,
        moe=moe,
        qkv_bias=bias,
        q_norm=_optional(gguf, p + "attn_q_norm.weight", cfg.qk_norm),
        k_norm=_optional(gguf, p + "attn_k_norm.weight", cfg.qk_norm),
        post_attn_norm=_optional(gguf, p + "post_attention_norm.weight", cfg.post_norms),
        post_ffn_norm=_optional(gguf, p + "post_ffw_norm.weight", cfg.post_norms),
        o_bias=_optional(gguf, p + "attn_output.bias", cfg.attn_out_bias),
        sinks=_optional(gguf, p + "attn_sinks.weight", cfg.attn_sinks),
    )


def expert_store(gguf: GGUFFile, cfg: ModelConfig, fmt: WeightFormat,
                  moe: MoEOptions) -> ExpertStore:
    slices = [expert_slices(gguf, i, cfg.n_experts, cfg.hidden_size, cfg.expert_ffn_size)
              for i in range(cfg.n_layers)]
    if moe.stream:
        packed = fmt.name == "q4" and all(
            t.ggml_type in PACKED_TYPES for s in slices for t in (s.gate, s.up, s.down))
        return StreamedExperts(gguf.parts, slices, fmt.linear_from_raw, moe.cache_bytes,
                               packed=packed, pilot=moe.pilot, pinned_share=moe.pinned_share)
    build = fmt.linear_from_raw
    if fmt.name == "q4":  # resident experts are streamed every step like any weight: huge pages
        arena = WeightArena.for_tensors(t for s in slices for t in (s.gate, s.up, s.down))
        build = functools.partial(fmt.linear_from_raw, alloc=arena)
    return ResidentExperts(gguf, slices, build)


class DecoderModel:
    """A decoder-only transformer as its configuration describes it (see module doc)."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: Embedding,
        layers: list[DecoderLayer],
        output_norm: torch.Tensor,
        output: Linear,
        freq_factors: torch.Tensor | None = None,
        norm: Norm | None = None,
        experts: ExpertStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.experts = experts  # a mixture-of-experts model's expert store
        self.norm = norm or rms_norm  # RMSNorm(x, weight, eps)
        self.embed = embed
        self.layers = layers
        self.output_norm = output_norm
        self.output = output
        # a reranker's classification head over the last state: (weight, bias); its
        # outputs are scores, ember.engine.embedding
        self.classifier: RankHead | None = None
        # one rotation table per distinct RoPE (Gemma's local and global layers)
        self.ropes = {
            key: RotaryEmbedding(cfg.rope_dim, key[0], freq_factors, cfg.rope_neox, key[1],
                                 key[2], cfg.rope_attn_factor, cfg.rope_yarn)
            for key in rope_keys(cfg)}
        self.rope = self.ropes[rope_key(cfg.layer_attention(0))]
        self.glu = GLUS[cfg.activation]
        # The whole stack in one native call per step, where the configuration and the
        # weights allow it; None: the op-by-op PyTorch path below, the oracle.
        self.native = native_decoder(cfg, layers)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, cfg: ModelConfig, fmt: WeightFormat,
                  moe: MoEOptions | None = None) -> DecoderModel:
        moe = moe or MoEOptions()
        experts = expert_store(gguf, cfg, fmt, moe) if cfg.n_experts else None
        layers = []
        for i in range(cfg.n_layers):
            layers.append(load_layer(gguf, cfg, fmt, i, experts, moe.top_p))
            # the layer is in its own tensors now: its file pages need not stay resident
            # (loading then never holds the whole file and every packed copy at once)
            gguf.release_pages()
        embed = fmt.embedding(gguf, "token_embd.weight", tied=cfg.tied_embeddings)
        tied = embed.tied_linear() if cfg.tied_embeddings else None
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        output = tied or fmt.linear(gguf, [head_name])  # a tied dense head shares storage
        factors = cfg.rope_factors_tensor
        freq_factors = load_dense(gguf, factors) if factors in gguf.tensors else None
        model = cls(cfg, embed, layers, load_dense(gguf, "output_norm.weight"), output,
                    freq_factors, norm_for(fmt.name), experts)
        model.classifier = load_rank_head(gguf)  # a reranker's (Qwen3-Reranker)
        if fmt.name == "q4" and not model.batch_invariant:
            log.warning("%s: not every projection and the output head have a packed "
                        "layout here (tensors of other types stay dense f32), so q4 runs "
                        "(partly) op by op and a request's logits may differ slightly with "
                        "the batch (tokens only at near-ties)",
                        gguf.path.name)
        return model

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits are bitwise independent of the rest of the batch: the
        native stack runs every layer and the head is a packed matrix (per-row kernel)."""
        return self.native is not None and isinstance(self.output, QuantLinear)

    def new_kv_storage(self, num_blocks: int, block_size: int,
                       dtype: str | torch.dtype | KVDtype = "f32",
                       num_seqs: int = 1, num_snapshots: int = 0) -> KVStorage:
        """The paged K/V pool (a hybrid model adds recurrent states for ``num_seqs``
        sequences at once and ``num_snapshots`` snapshots of them)."""
        c = self.cfg
        return KVStorage(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, dtype)

    def score(self, token_ids: list[int], block_size: int = 16,
              kv_dtype: str | torch.dtype | KVDtype = "f32", lora: Any = None) -> torch.Tensor:
        """Logits at every position of one sequence (teacher forcing), shape (T, vocab).

        Uses a private KV pool (of ``kv_dtype``: a name in ember.kv.dtypes.KV_DTYPES or
        a float format's torch dtype); meant for evaluation and tests. ``lora``: an
        adapter (:class:`ember.models.lora.LoRAAdapter`) every token runs with.
        """
        n = len(token_ids)
        n_blocks = blocks_for(n, block_size)
        table = BlockTable(BlockAllocator(n_blocks), block_size)
        table.reserve(n)
        batch = AttentionBatch.build([RowSpec(table.block_ids(n), 0, n, state=0)], block_size)
        if lora is not None:
            from ember.models.lora import LoRABatch

            batch.lora = LoRABatch.of_rows([lora], [n])
        kv = self.new_kv_storage(n_blocks, block_size, kv_dtype)
        kv.zero_blocks(table.allocator.take_unzeroed())
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
        x = self._residual(tokens, batch, kv)
        rows = x[batch.row_ends if logits_index is None else logits_index]
        logits = self.output(self.norm(rows, self.output_norm, c.norm_eps))
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.final_softcap:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    @torch.inference_mode()
    def hidden_states(self, tokens: torch.Tensor, batch: AttentionBatch, kv: KVStorage
                      ) -> torch.Tensor:
        """The final hidden state of every token (T, hidden), after the output norm:
        what the output head reads, and what an embedding pools."""
        return self.norm(self._residual(tokens, batch, kv), self.output_norm, self.cfg.norm_eps)

    def _residual(self, tokens: torch.Tensor, batch: AttentionBatch, kv: KVStorage
                  ) -> torch.Tensor:
        """The residual stream after the last layer, from the tokens."""
        x = self.embed(tokens)
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        ok = False
        try:
            x = self.decode_layers(x, batch, kv)
            ok = True
        finally:
            if self.experts is not None:
                self.experts.end_step(ok)
        return x

    @torch.inference_mode()
    def decode_layers(self, x: torch.Tensor, batch: AttentionBatch, kv: KVStorage) -> torch.Tensor:
        """The residual stream (T, hidden) after every layer, from the embeddings ``x``."""
        if self.native is not None:
            return self.native_layers(x, batch, kv)
        rotations = {key: rope.rotation(batch.positions) for key, rope in self.ropes.items()}
        q_scale = attention_temperature(self.cfg, batch.positions)
        slots = (batch.slot_mapping // batch.block_size, batch.slot_mapping % batch.block_size)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, batch, kv, rotations, slots, q_scale)
        return x

    def native_layers(self, x: torch.Tensor, batch: AttentionBatch, kv: KVStorage,
                      **states: torch.Tensor) -> torch.Tensor:
        """``decode_layers`` by the native stack; ``states``: a hybrid model's recurrent
        ``conv_state``, ``ssm_state`` (updated in place) and ``token_state``, each
        token's state slot."""
        assert self.native is not None
        x = x.clone(memory_format=torch.contiguous_format)  # updated in place
        ropes = [torch.view_as_real(rope.rotation(batch.positions)).contiguous()
                 for rope in self.ropes.values()]  # in rope_keys order
        adapters, which = ((None, None) if batch.lora is None
                           else batch.lora.native(self.native, x.shape[0]))
        token_state = states.pop("token_state", None)
        token_snap = states.pop("token_snap", None)
        # a long step runs the stack over slices of tokens in order, so its scratch
        # (~130 KB a token at 1B) is a slice's: each slice writes its K/V (and its rows'
        # recurrent states) before the next reads them, and rows are computed alike in
        # any batch, so the result is the same bits as one call
        for a in range(0, x.shape[0], NATIVE_SLICE_TOKENS):
            part = slice(a, a + NATIVE_SLICE_TOKENS)
            extra = {} if token_state is None else {**states, "token_state": token_state[part]}
            if token_snap is not None:
                extra["token_snap"] = token_snap[part]
            self.native.forward(x[part], kv.pool, [r[part] for r in ropes],
                                batch.slot_mapping[part], batch.tables,
                                batch.token_rows[part], batch.positions[part],
                                *([] if adapters is None else [adapters, which[part]]),
                                **extra)
        return x

    def _layer(self, i: int, layer: DecoderLayer, x: torch.Tensor, batch: AttentionBatch,
               kv: KVStorage, rotations: dict[RopeKey, torch.Tensor],
               slots: tuple[torch.Tensor, torch.Tensor],
               q_scale: torch.Tensor | None) -> torch.Tensor:
        c, n = self.cfg, x.shape[0]
        q_dim, kv_dim = c.n_heads * c.head_dim, c.kv_dim
        kind = c.layer_attention(i)
        h = x if layer.attn_norm is None else self.norm(x, layer.attn_norm, c.norm_eps)
        qkv = layer.qkv(h)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        lora = batch.lora
        if lora is not None:
            qkv = lora.add(i, "qkv", h, qkv)
        q = qkv[:, :q_dim].view(n, c.n_heads, c.head_dim)
        k = qkv[:, q_dim:q_dim + kv_dim].view(n, c.n_kv_heads, c.head_dim)
        v = qkv[:, q_dim + kv_dim:].reshape(n, c.n_kv_heads, c.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            width = -1 if c.qk_norm_full else c.head_dim  # all heads at once, or each
            q = self.norm(q.reshape(n if c.qk_norm_full else -1, width), layer.q_norm,
                          c.norm_eps).view(q.shape)
            k = self.norm(k.reshape(n if c.qk_norm_full else -1, width), layer.k_norm,
                          c.norm_eps).view(k.shape)
        rope, rotation = self.ropes[rope_key(kind)], rotations[rope_key(kind)]
        q, k = rope.apply(q, rotation), rope.apply(k, rotation)
        if q_scale is not None:  # Llama 4's attention temperature
            q = q * q_scale[:, None, None]
        kv.write(i, *slots, k, v)
        attn = paged_attention(q, kv.k[i], kv.v[i], batch, window=kind.window,
                               scale=c.softmax_scale, softcap=c.attn_softcap, sinks=layer.sinks)
        out = layer.o(attn.reshape(n, q_dim))
        if lora is not None:
            out = lora.add(i, "o", attn.reshape(n, q_dim), out)
        if layer.o_bias is not None:
            out = out + layer.o_bias
        if layer.post_attn_norm is not None:
            out = self.norm(out, layer.post_attn_norm, c.norm_eps)
        x = x + out if c.residual_scale == 1.0 else x + c.residual_scale * out
        h = x if layer.ffn_norm is None else self.norm(x, layer.ffn_norm, c.norm_eps)
        out = self._ffn(layer, h, lora, i)
        if layer.post_ffn_norm is not None:
            out = self.norm(out, layer.post_ffn_norm, c.norm_eps)
        return x + out if c.residual_scale == 1.0 else x + c.residual_scale * out

    def _ffn(self, layer: Any, h: torch.Tensor, lora: Any = None, i: int = -1
             ) -> torch.Tensor:
        """A layer's feed-forward part of ``h``: routed experts, or the gated MLP (with
        each row's LoRA deltas on gate, up and down, ``i`` being the layer's index)."""
        if layer.moe is not None:
            return layer.moe(h)
        assert layer.gate_up is not None and layer.down is not None
        if lora is None:
            return gated_mlp(layer.gate_up, layer.down, self.glu, h)
        gate_up = lora.add(i, "gate_up", h, layer.gate_up(h))
        act = self.glu(*gate_up.chunk(2, dim=-1))
        return lora.add(i, "down", act, layer.down(act))
