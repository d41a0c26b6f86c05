"""Qwen 3.5: a hybrid of Gated DeltaNet linear attention and gated attention.

Three layers in four (the file's ``recurrent_layers``, else every layer but each
``full_attention_interval``-th) replace attention with a Gated DeltaNet: the q|k|v
projection goes through a causal depthwise convolution (``conv`` taps, SiLU), q and k
are L2-normalised (q also by 1/sqrt(k_dim)), and each value head keeps a state
``S`` (k_dim x v_dim) that decays and is corrected by the delta rule at every token:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

with g = -exp(A_log) softplus(alpha + dt_bias) and beta = sigmoid(b) per head and
token. The output is RMS-normed per head, gated by SiLU(z) and projected back. The
state (and the last ``conv - 1`` inputs of the convolution) is the sequence's whole
memory of those layers: it lives in a slot per running sequence
(:class:`RecurrentStates`, beside the paged KV of the attention layers) and is zeroed
when a sequence starts at position 0. It cannot be rebuilt from cached blocks, so a
step may also copy a row's state after one of its tokens to a snapshot slot, which
the prefix cache restores into another sequence's slot (ember.kv.snapshots); it cannot
be rewound either, so the engine runs such models without speculation.

The other layers are Qwen 3's attention (per-head q/k RMSNorm, NEOX RoPE over the
leading ``rope_dim`` dims) whose q projection also yields a gate: the attention
output is multiplied by sigmoid(gate) before the output projection. The rotary
embedding is interleaved MRoPE in the checkpoint; for text every section sees the
same position, which is plain RoPE. The MLP's pre-norm is ``post_attention_norm``;
in ``qwen35moe`` every MLP is a router over experts plus a shared expert whose output
is scaled by sigmoid(gate · h). A multi-token-prediction head (``nextn_predict_layers``)
is not run.

Where every projection is packed (``--weights q4``) the whole stack runs natively
(``ember/kernels/delta_net.h`` inside ``fused_decoder.h``): one call per step, each
row's scan token by token. The PyTorch path here is its oracle: decode rows share one
batched state update per layer; a prefill chunk runs its tokens one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ember.errors import UnsupportedModelError
from ember.kv.blocks import KVStorage
from ember.kv.dtypes import KVDtype
from ember.models.config import DeltaNetShape, ModelConfig
from ember.models.decoder import (
    DecoderLayer,
    DecoderModel,
    expert_store,
    load_ffn,
    load_layer,
)
from ember.models.gguf import GGUFFile
from ember.models.layers.attention import AttentionBatch, paged_attention
from ember.models.layers.rope import RopeKey, rope_key
from ember.models.linear import Linear, WeightFormat, load_dense
from ember.models.moe import ExpertStore, MoEFeedForward, MoEOptions


def configure(gguf: GGUFFile, base: ModelConfig) -> dict[str, Any]:
    arch = base.architecture

    def key(name: str) -> int:
        return int(gguf.require(f"{arch}.{name}"))

    n_layers = base.n_layers - int(gguf.get(f"{arch}.nextn_predict_layers", 0))
    flags = gguf.get(f"{arch}.attention.recurrent_layers")
    if flags is None:
        every = int(gguf.get(f"{arch}.full_attention_interval", 4))
        flags = [(i + 1) % every != 0 for i in range(n_layers)]
    recurrent = tuple(bool(f) for f in list(flags)[:n_layers])
    n_k, k_dim, n_v = key("ssm.group_count"), key("ssm.state_size"), key("ssm.time_step_rank")
    inner = key("ssm.inner_size")
    if inner % n_v or n_v % n_k:
        raise UnsupportedModelError(
            f"{gguf.path.name}: {arch}.ssm.inner_size {inner} / time_step_rank {n_v} / "
            f"group_count {n_k} do not make whole value heads per key head")
    moe = {}
    if arch.endswith("moe"):  # qwen35moe: every FFN routed, plus a shared expert
        moe = {"n_experts": key("expert_count"), "n_experts_used": key("expert_used_count"),
               "expert_ffn_size": key("expert_feed_forward_length"),
               "shared_expert_ffn_size": int(gguf.get(
                   f"{arch}.expert_shared_feed_forward_length", base.ffn_size))}
    return {**moe, "n_layers": n_layers, "rope_neox": True, "qk_norm": True,
            "ffn_norm_tensor": "post_attention_norm", "attn_output_gate": True,
            "recurrent_layers": recurrent,
            "delta_net": DeltaNetShape(key("ssm.conv_kernel"), n_k, k_dim, n_v, inner // n_v)}


@dataclass
class DeltaNetLayer:
    attn_norm: torch.Tensor
    # x -> the convolution's q | k | v channels, the output gate z (n_v_heads * v_dim),
    # then per value head b (the update's strength before the sigmoid) and alpha (the
    # decay's input): one matrix, as the native stack multiplies it
    in_proj: Linear
    conv: torch.Tensor  # (channels, taps)
    dt_bias: torch.Tensor  # (n_v_heads,)
    a: torch.Tensor  # (n_v_heads,) = -exp(A_log)
    norm: torch.Tensor  # (v_dim,) the per-head output RMSNorm
    out: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None  # None: routed experts (``moe``) instead
    down: Linear | None
    moe: MoEFeedForward | None = None

    def native_mixer(self, ext: Any, in_proj: Any, out: Any, cfg: ModelConfig) -> Any:
        """This layer's Gated DeltaNet as the native stack's (``ext.DeltaNet``), on the
        stack's handles ``in_proj`` and ``out`` of its packed matrices."""
        s = cfg.delta_net
        assert s is not None
        return ext.DeltaNet(in_proj, out, self.conv.contiguous(), self.dt_bias.contiguous(),
                            self.a.contiguous(), self.norm.contiguous(), s.n_k_heads, s.k_dim,
                            s.n_v_heads, s.v_dim, cfg.norm_eps)


def load_delta_net_layer(gguf: GGUFFile, cfg: ModelConfig, fmt: WeightFormat, i: int,
                         experts: ExpertStore | None = None,
                         moe_top_p: float = 1.0) -> DeltaNetLayer:
    p = f"blk.{i}."
    shape = cfg.delta_net
    assert shape is not None
    conv = load_dense(gguf, p + "ssm_conv1d.weight")
    if tuple(conv.shape) != (shape.channels, shape.conv):
        raise UnsupportedModelError(f"{gguf.path.name}: {p}ssm_conv1d.weight is "
                                    f"{tuple(conv.shape)}, expected "
                                    f"({shape.channels}, {shape.conv})")
    gate_up, down, moe = load_ffn(gguf, cfg, fmt, i, experts, moe_top_p)
    return DeltaNetLayer(
        attn_norm=load_dense(gguf, p + "attn_norm.weight"),
        in_proj=fmt.linear(gguf, [p + f"{x}.weight" for x in (
            "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")]),
        conv=conv,
        dt_bias=load_dense(gguf, p + "ssm_dt.bias"),
        a=load_dense(gguf, p + "ssm_a"),
        norm=load_dense(gguf, p + "ssm_norm.weight"),
        out=fmt.linear(gguf, [p + "ssm_out.weight"]),
        ffn_norm=load_dense(gguf, p + "post_attention_norm.weight"),
        gate_up=gate_up, down=down, moe=moe)


class RecurrentStates:
    """Every recurrent layer's state for ``slots`` sequences: the convolution's last
    ``conv - 1`` inputs and the DeltaNet's per-head matrices, in f32; and ``snapshots``
    slots laid out alike for copies of them (zeroed memory: pages are touched as used)."""

    def __init__(self, n_layers: int, slots: int, shape: DeltaNetShape,
                 snapshots: int = 0) -> None:
        self.conv = torch.zeros(n_layers, slots, shape.conv - 1, shape.channels)
        self.ssm = torch.zeros(n_layers, slots, shape.n_v_heads, shape.k_dim, shape.v_dim)
        self.snap_conv = torch.zeros(n_layers, snapshots, shape.conv - 1, shape.channels)
        self.snap_ssm = torch.zeros(n_layers, snapshots, shape.n_v_heads, shape.k_dim,
                                    shape.v_dim)

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() + self.ssm.numel()) * 4

    @property
    def snapshot_nbytes(self) -> int:
        return (self.snap_conv.numel() + self.snap_ssm.numel()) * 4

    def restore(self, snapshot: int, slot: int) -> None:
        """A sequence's slot takes a snapshot's state (the prefix it was taken after)."""
        self.conv[:, slot] = self.snap_conv[:, snapshot]
        self.ssm[:, slot] = self.snap_ssm[:, snapshot]

    def reset(self, slots: list[int]) -> None:
        index = torch.tensor(slots, dtype=torch.long)
        self.conv[:, index] = 0
        self.ssm[:, index] = 0


class HybridKVStorage(KVStorage):
    """The paged K/V of the attention layers, and the recurrent layers' states."""

    def __init__(self, n_attention_layers: int, num_blocks: int, block_size: int,
                 n_kv_heads: int, head_dim: int, dtype: str | torch.dtype | KVDtype,
                 states: RecurrentStates) -> None:
        super().__init__(n_attention_layers, num_blocks, block_size, n_kv_heads, head_dim,
                         dtype)
        self.states = states

    @property
    def bytes_per_snapshot(self) -> int:
        s = self.states
        return (s.snap_conv[:, 0].numel() + s.snap_ssm[:, 0].numel()) * 4

    def snapshot_bytes(self, slot: int) -> bytes:
        """A snapshot slot's state (every recurrent layer's conv window, then matrices)."""
        s = self.states
        return torch.cat((s.snap_conv[:, slot].flatten(),
                          s.snap_ssm[:, slot].flatten())).numpy().tobytes()

    def load_snapshot(self, slot: int, data: bytes) -> None:
        """Fill a snapshot slot with what :meth:`snapshot_bytes` gave."""
        s = self.states
        flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
        n = s.snap_conv[:, 0].numel()
        s.snap_conv[:, slot] = flat[:n].view_as(s.snap_conv[:, slot])
        s.snap_ssm[:, slot] = flat[n:].view_as(s.snap_ssm[:, slot])


class Qwen35Model(DecoderModel):
    """Qwen 3.5's hybrid stack (see module doc), PyTorch op by op."""

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, cfg: ModelConfig, fmt: WeightFormat,
                  moe: MoEOptions | None = None) -> DecoderModel:
        moe = moe or MoEOptions()
        experts = expert_store(gguf, cfg, fmt, moe) if cfg.n_experts else None
        layers: list[Any] = []
        for i in range(cfg.n_layers):
            load = load_delta_net_layer if cfg.is_recurrent(i) else load_layer
            layers.append(load(gguf, cfg, fmt, i, experts, moe.top_p))
            gguf.release_pages()
        embed = fmt.embedding(gguf, "token_embd.weight", tied=cfg.tied_embeddings)
        tied = embed.tied_linear() if cfg.tied_embeddings else None
        output = tied or fmt.linear(gguf, ["output.weight"])
        return cls(cfg, embed, layers, load_dense(gguf, "output_norm.weight"), output,
                   experts=experts)

    def new_kv_storage(self, num_blocks: int, block_size: int,
                       dtype: str | torch.dtype | KVDtype = "f32",
                       num_seqs: int = 1, num_snapshots: int = 0) -> KVStorage:
        c = self.cfg
        assert c.delta_net is not None
        states = RecurrentStates(sum(c.recurrent_layers), num_seqs, c.delta_net, num_snapshots)
        return HybridKVStorage(len(c.kv_layers), num_blocks, block_size, c.n_kv_heads,
                               c.head_dim, dtype, states)

    @torch.inference_mode()
    def decode_layers(self, x: torch.Tensor, batch: AttentionBatch, kv: KVStorage
                      ) -> torch.Tensor:
        assert isinstance(kv, HybridKVStorage)
        states = kv.states
        starting = [row.state for row in batch.rows if row.start == 0]
        if any(row.state < 0 for row in batch.rows):
            raise ValueError("every row of a recurrent model needs a state slot")
        if starting:
            states.reset(starting)
        snaps = batch.token_snapshots()
        if self.native is not None:
            token_state = torch.repeat_interleave(
                torch.tensor([row.state for row in batch.rows]),
                torch.tensor([row.q_len for row in batch.rows]))
            extra = {} if snaps is None else {"snap_conv": states.snap_conv,
                                              "snap_ssm": states.snap_ssm, "token_snap": snaps}
            return self.native_layers(x, batch, kv, conv_state=states.conv,
                                      ssm_state=states.ssm, token_state=token_state, **extra)
        rotations = {key: rope.rotation(batch.positions) for key, rope in self.ropes.items()}
        slots = (batch.slot_mapping // batch.block_size, batch.slot_mapping % batch.block_size)
        kv_index = {layer: j for j, layer in enumerate(self.cfg.kv_layers)}
        recurrent = 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DeltaNetLayer):
                x = self._delta_net_layer(layer, x, batch, states, recurrent)
                recurrent += 1
            else:
                x = self._gated_attention_layer(layer, x, batch, kv, kv_index[i], rotations,
                                                slots)
        return x

    # ------------------------------------------------------------ attention layers
    def _gated_attention_layer(self, layer: DecoderLayer, x: torch.Tensor,
                               batch: AttentionBatch, kv: KVStorage, j: int,
                               rotations: dict[RopeKey, torch.Tensor],
                               slots: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        c, n = self.cfg, x.shape[0]
        q_dim, kv_dim, hd = c.n_heads * c.head_dim, c.kv_dim, c.head_dim
        assert layer.attn_norm is not None and layer.q_norm is not None \
            and layer.k_norm is not None and layer.ffn_norm is not None
        qkv = layer.qkv(self.norm(x, layer.attn_norm, c.norm_eps))
        q_gate = qkv[:, :2 * q_dim].view(n, c.n_heads, 2 * hd)  # per head: query, gate
        q = self.norm(q_gate[..., :hd].reshape(-1, hd), layer.q_norm, c.norm_eps)
        k = self.norm(qkv[:, 2 * q_dim:2 * q_dim + kv_dim].reshape(-1, hd), layer.k_norm,
                      c.norm_eps).view(n, c.n_kv_heads, hd)
        v = qkv[:, 2 * q_dim + kv_dim:].reshape(n, c.n_kv_heads, hd)
        key = rope_key(c.layer_attention(0))
        rope, rotation = self.ropes[key], rotations[key]
        q, k = rope.apply(q.view(n, c.n_heads, hd), rotation), rope.apply(k, rotation)
        kv.write(j, *slots, k, v)
        attn = paged_attention(q, kv.k[j], kv.v[j], batch, scale=c.softmax_scale)
        attn = attn.reshape(n, q_dim) * torch.sigmoid(q_gate[..., hd:].reshape(n, q_dim))
        x = x + layer.o(attn)
        return x + self._ffn(layer, self.norm(x, layer.ffn_norm, c.norm_eps))

    # ------------------------------------------------------------ recurrent layers
    def _delta_net_layer(self, layer: DeltaNetLayer, x: torch.Tensor, batch: AttentionBatch,
                         states: RecurrentStates, r: int) -> torch.Tensor:
        c = self.cfg
        shape = c.delta_net
        assert shape is not None
        h = self.norm(x, layer.attn_norm, c.norm_eps)
        mixed, z, b, alpha = layer.in_proj(h).split(
            [shape.channels, shape.n_v_heads * shape.v_dim, shape.n_v_heads,
             shape.n_v_heads], dim=-1)
        beta = torch.sigmoid(b)  # (T, n_v)
        decay = torch.exp(layer.a * F.softplus(alpha + layer.dt_bias))  # (T, n_v)
        out = torch.empty(x.shape[0], shape.n_v_heads, shape.v_dim)
        decode, offset = [], 0
        for row in batch.rows:
            span = slice(offset, offset + row.q_len)
            if row.q_len == 1:
                decode.append((offset, row.state))
            else:
                out[span] = self._delta_net_row(layer, mixed[span], beta[span], decay[span],
                                                states, r, row.state, row.snapshot)
            offset += row.q_len
        if decode:
            index = torch.tensor([o for o, _ in decode])
            slots = torch.tensor([s for _, s in decode])
            out[index] = self._delta_net_decode(layer, mixed[index], beta[index],
                                                decay[index], states, r, slots)
            for row in batch.rows:  # a decode row's snapshot: its state after its token
                if row.q_len == 1 and row.snapshot is not None:
                    states.snap_conv[r, row.snapshot[1]] = states.conv[r, row.state]
                    states.snap_ssm[r, row.snapshot[1]] = states.ssm[r, row.state]
        z = z.reshape(-1, shape.n_v_heads, shape.v_dim)
        core = self.norm(out.reshape(-1, shape.v_dim), layer.norm, c.norm_eps)
        core = core.view_as(out) * F.silu(z)
        x = x + layer.out(core.reshape(x.shape[0], -1))
        return x + self._ffn(layer, self.norm(x, layer.ffn_norm, c.norm_eps))

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (repeated to every value head, L2-normalised; q scaled) and v of the
        convolution's output (N, channels)."""
        s = self.cfg.delta_net
        assert s is not None
        n, key_width = conv_out.shape[0], s.n_k_heads * s.k_dim
        q = conv_out[:, :key_width].reshape(n, s.n_k_heads, s.k_dim)
        k = conv_out[:, key_width:2 * key_width].reshape(n, s.n_k_heads, s.k_dim)
        v = conv_out[:, 2 * key_width:].reshape(n, s.n_v_heads, s.v_dim)
        repeat = s.n_v_heads // s.n_k_heads  # value head j reads key head j % n_k_heads
        q, k = q.repeat(1, repeat, 1), k.repeat(1, repeat, 1)
        eps = self.cfg.norm_eps
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) / s.k_dim ** 0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
        return q, k, v

    def _delta_net_row(self, layer: DeltaNetLayer, mixed: torch.Tensor, beta: torch.Tensor,
                       decay: torch.Tensor, states: RecurrentStates, r: int,
                       slot: int, snapshot: tuple[int, int] | None = None) -> torch.Tensor:
        """One sequence's chunk of tokens, in order, from its slot's state (its state
        after token ``snapshot[0]`` also copied to snapshot slot ``snapshot[1]``)."""
        taps = layer.conv.shape[1]
        seq = torch.cat((states.conv[r, slot], mixed))  # (taps - 1 + n, channels)
        states.conv[r, slot] = seq[seq.shape[0] - (taps - 1):]
        conv_out = F.silu(F.conv1d(seq.T[None], layer.conv[:, None],
                                   groups=layer.conv.shape[0])[0].T)
        q, k, v = self._qkv(conv_out)
        state = states.ssm[r, slot].clone()  # (n_v, k_dim, v_dim)
        out = torch.empty_like(v)
        for t in range(v.shape[0]):
            state *= decay[t, :, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t, :, None]
            state += k[t, :, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, q[t])
            if snapshot is not None and snapshot[0] == t:
                states.snap_ssm[r, snapshot[1]] = state
                states.snap_conv[r, snapshot[1]] = seq[t + 1:t + taps]
        states.ssm[r, slot] = state
        return out

    def _delta_net_decode(self, layer: DeltaNetLayer, mixed: torch.Tensor, beta: torch.Tensor,
                          decay: torch.Tensor, states: RecurrentStates, r: int,
                          slots: torch.Tensor) -> torch.Tensor:
        """One token of each of several sequences, their states updated together."""
        seq = torch.cat((states.conv[r, slots], mixed[:, None]), dim=1)  # (B, taps, ch)
        states.conv[r, slots] = seq[:, 1:]
        conv_out = F.silu((seq * layer.conv.T[None]).sum(1))
        q, k, v = self._qkv(conv_out)
        state = states.ssm[r, slots] * decay[:, :, None, None]  # (B, n_v, k_dim, v_dim)
        delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[:, :, None]
        state = state + k[..., None] * delta[:, :, None, :]
        states.ssm[r, slots] = state
        return torch.einsum("bhkv,bhk->bhv", state, q)
