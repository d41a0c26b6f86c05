"""Architecture hyper-parameters, read from GGUF metadata.

The keys every decoder-only family shares (``{arch}.block_count``, head counts, …)
are read here; what a family does differently (RoPE layout, sliding-window layers,
extra norms, biases, activation) it says in its own ``configure`` hook, found
through :mod:`ember.models.architectures`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ember.errors import UnsupportedModelError
from ember.models.gguf import GGUFFile

Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]  # ember.models.layers.mlp.GLUS


@dataclass(frozen=True)
class Yarn:
    """YaRN's frequency blend (as transformers and ggml compute it): dims that turn
    more than ``beta_fast`` times over the original context keep their frequency, those
    turning fewer than ``beta_slow`` times are divided by ``factor``, a linear ramp
    between; cos and sin are scaled by the attention factor (``rope_attn_factor``)."""

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention kind: how far back it looks and its RoPE base."""

    rope_base: float
    window: int | None = None  # sliding window (positions attended, itself included); None: all
    rope_scale: float = 1.0  # linear RoPE scaling: positions divided by it
    rope: bool = True  # False: no rotary embedding at all (SmolLM3's NoPE layers)


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet (linear attention) layer's shape: ``n_k_heads`` query/key heads
    of ``k_dim``, ``n_v_heads`` value heads of ``v_dim`` (value head ``j`` reads key head
    ``j % n_k_heads``, llama.cpp's layout), a causal depthwise convolution of ``conv``
    taps over the q|k|v channels."""

    conv: int
    n_k_heads: int
    k_dim: int
    n_v_heads: int
    v_dim: int

    @property
    def channels(self) -> int:
        return 2 * self.n_k_heads * self.k_dim + self.n_v_heads * self.v_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden_size: int
    ffn_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int  # leading dims of each head that RoPE rotates (llama.cpp's n_rot)
    rope_base: float
    rope_scale: float  # linear RoPE scaling of the file (1.0: none); families may narrow it
    norm_eps: float
    vocab_size: int
    context_length: int
    tied_embeddings: bool
    # --- what families vary (defaults: llama) ---
    # RoPE pairs: adjacent dims (x[2i], x[2i+1]), ggml's "normal" rope, or dims half a
    # head apart (x[i], x[i + rope_dim/2]), the NEOX layout HF checkpoints use
    rope_neox: bool = False
    layers: tuple[LayerAttention, ...] = ()  # per layer; empty: all full, base rope_base
    attn_scale: float | None = None  # softmax scale of q·k; None: 1/sqrt(head_dim)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden))
    qkv_bias: bool = False  # Q/K/V projections carry biases (Qwen2)
    attn_out_bias: bool = False  # the attention output projection carries one (gpt-oss)
    attn_sinks: bool = False  # a learned logit per head joins each softmax (gpt-oss)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_full: bool = False  # that norm spans all heads of q (of k) at once (OLMo 2)
    pre_norms: bool = True  # False: sublayers read the raw residual stream (OLMo 2)
    post_norms: bool = False  # attention and MLP outputs normed before the residual (Gemma)
    ffn_norm_tensor: str = "ffn_norm"  # the MLP's pre-norm (gpt-oss: post_attention_norm)
    residual_scale: float = 1.0  # sublayer outputs multiplied by it before the add (Granite)
    attn_softcap: float = 0.0  # scores s -> c·tanh(s/c) before the softmax; 0: none (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits
    logit_scale: float = 1.0  # logits multiplied by it (Granite divides by its logit_scale)
    rope_factors_tensor: str = "rope_freqs.weight"  # per-frequency RoPE factors, if present
    rope_yarn: Yarn | None = None  # YaRN context extension (rope.scaling.type "yarn")
    rope_attn_factor: float = 1.0  # cos and sin multiplied by it (LongRoPE's attention factor)
    # Llama 4's attention temperature (Mistral 3): queries multiplied by
    # 1 + scale·ln(1 + ⌊position / floor⌋), i.e. 1 within the first ``floor`` positions
    attn_temperature_scale: float = 0.0  # 0: none
    attn_temperature_floor: int = 0
    activation: Activation = "silu"  # of the gate in gate * up
    # mixture of experts (every layer's FFN): experts per layer, used per token, FFN size
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0
    expert_biases: bool = False  # the router and every expert projection carry biases
    shared_expert_ffn_size: int = 0  # an expert every token takes, sigmoid-gated (Qwen 3.5)
    # how an embedding pools the final hidden states ({arch}.pooling_type; None: the
    # file names none), ember.engine.embedding
    pooling_type: int | None = None
    # False: an encoder (BERT): tokens attend both ways, it embeds and does not generate
    causal: bool = True
    # hybrid models (Qwen 3.5): per layer, True where a recurrent (linear attention)
    # layer stands instead of attention; such layers keep a state per sequence, not KV
    recurrent_layers: tuple[bool, ...] = ()
    delta_net: DeltaNetShape | None = None
    attn_output_gate: bool = False  # q projection doubled: a sigmoid gate per output dim

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a per-sequence recurrent state."""
        return any(self.recurrent_layers)

    @property
    def state_bytes_per_sequence(self) -> int:
        """A sequence's recurrent state in f32 (a snapshot of it takes as much): every
        recurrent layer's convolution window and per-value-head matrices."""
        s = self.delta_net
        if s is None:
            return 0
        return 4 * sum(self.recurrent_layers) * (
            (s.conv - 1) * s.channels + s.n_v_heads * s.k_dim * s.v_dim)

    def is_recurrent(self, layer: int) -> bool:
        """Whether ``layer`` keeps a recurrent state instead of K/V (a hybrid's)."""
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep K/V in the paged cache, in order."""
        return [i for i in range(self.n_layers) if not self.is_recurrent(i)]

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def layer_attention(self, i: int) -> LayerAttention:
        return self.layers[i] if self.layers else LayerAttention(self.rope_base, None,
                                                                 self.rope_scale)

    @classmethod
    def common(cls, gguf: GGUFFile) -> ModelConfig:
        """The fields every family reads from the same GGUF keys (a family's own are
        added by :func:`ember.models.architectures.model_config`)."""
        arch = gguf.architecture

        def key(name: str) -> object:
            return gguf.require(f"{arch}.{name}")

        hidden = int(key("embedding_length"))
        ffn = gguf.get(f"{arch}.feed_forward_length")
        if ffn is None:  # MoE files may give only the experts' size
            ffn = key("expert_feed_forward_length")
        n_heads = int(key("attention.head_count"))
        head_dim = int(gguf.get(f"{arch}.attention.key_length", hidden // n_heads))
        vocab = gguf.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = gguf.tensor("token_embd.weight").shape[0]
        base = cls(
            architecture=arch,
            n_layers=int(key("block_count")),
            hidden_size=hidden,
            ffn_size=int(ffn),
            n_heads=n_heads,
            n_kv_heads=int(gguf.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_dim=int(gguf.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_base=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scale=rope_linear_scale(gguf),
            norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon")
                           or key("attention.layer_norm_epsilon")),
            vocab_size=int(vocab),
            context_length=int(gguf.get(f"{arch}.context_length", 2048)),
            tied_embeddings="output.weight" not in gguf.tensors,
            pooling_type=None if gguf.get(f"{arch}.pooling_type") is None else int(
                gguf.get(f"{arch}.pooling_type")),
        )
        value_dim = int(gguf.get(f"{arch}.attention.value_length", head_dim))
        if value_dim != head_dim:
            raise UnsupportedModelError(f"{gguf.path.name}: value heads of {value_dim} dims "
                                        f"differ from key heads of {head_dim}")
        return base


# RoPE scalings a family may take on beyond "linear" (read by its configure hook, or
# for "yarn" by :func:`rope_yarn`, for families whose layers share one RoPE).
EXTENDED_ROPE_SCALINGS = ("longrope", "yarn")


def rope_linear_scale(gguf: GGUFFile) -> float:
    """The file's linear RoPE scaling factor (1.0 without one). YaRN and other scalings
    are refused by name: rotating by the plain table would run, and be wrong."""
    arch = gguf.architecture
    kind = gguf.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none") or kind in EXTENDED_ROPE_SCALINGS:
        return 1.0
    if kind == "linear":
        return float(gguf.require(f"{arch}.rope.scaling.factor"))
    raise UnsupportedModelError(f"{gguf.path.name}: RoPE scaling {kind!r} "
                                f"({arch}.rope.scaling.type) is not supported")


def rope_yarn(gguf: GGUFFile) -> dict[str, object]:
    """The ModelConfig fields of a YaRN file: its blend and its attention factor (the
    file's ``yarn_attn_factor`` if given, else as transformers derives it)."""
    arch = gguf.architecture
    if gguf.get(f"{arch}.rope.scaling.type") != "yarn":
        return {}
    factor = float(gguf.require(f"{arch}.rope.scaling.factor"))
    yarn = Yarn(factor, int(gguf.require(f"{arch}.rope.scaling.original_context_length")),
                float(gguf.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                float(gguf.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)))
    attn = gguf.get(f"{arch}.rope.scaling.yarn_attn_factor")
    if attn:
        return {"rope_yarn": yarn, "rope_attn_factor": float(attn)}
    # transformers' mscale / mscale_all_dim when the file gives the latter (as
    # yarn_log_multiplier; mscale taken as 1, as llama.cpp does), else mscale alone
    log_mul = float(gguf.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    mscale = _yarn_mscale(factor, 1.0)
    if log_mul:
        mscale /= _yarn_mscale(factor, log_mul)
    return {"rope_yarn": yarn, "rope_attn_factor": mscale}


def _yarn_mscale(factor: float, multiplier: float) -> float:
    return 0.1 * multiplier * math.log(factor) + 1.0 if factor > 1 else 1.0
