"""Low-rank adapters (LoRA) over a loaded base model, several in one batch.

An adapter changes a projection ``y = W x`` into ``y = W x + s · B (A x)`` with ``A``
(rank × in) and ``B`` (out × rank) small, for the projections it targets: any of
``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``, ``ffn_up``,
``ffn_down`` of any layer. Two file formats:

- llama.cpp's GGUF adapters (``general.type = adapter``, ``adapter.type = lora``,
  ``adapter.lora.alpha``; tensors ``blk.N.<target>.weight.lora_a`` / ``.lora_b``, as
  ``convert_lora_to_gguf.py`` writes them): ``s = alpha / rank`` (1 when alpha is 0),
  as llama.cpp applies them;
- PEFT directories (``adapter_config.json`` + ``adapter_model.safetensors``): HF module
  names mapped to GGUF's (``q_proj`` → ``attn_q`` …), ``s = lora_alpha / r`` (or
  ``/ sqrt(r)`` with ``use_rslora``); for a base whose GGUF permutes q and k for its
  RoPE layout (llama's adjacent pairs), ``B``'s rows are permuted the same way, as
  llama.cpp's converter does for the weights.

Everything is checked against the base at load — architecture, targets, shapes, rank
(``max_rank``) — and refused naming what does not fit. Deltas are kept in f32 or
bf16 (``dtype``; half the bytes a step reads per adapter) with ``s`` folded into ``B``,
B transposed (the native kernel reads a block of its columns contiguously). An
adapter's identity is the hash of its file bytes: the
prefix cache keys requests with an adapter apart from the base and from other
adapters, so a cached prefix is never served across them.

:class:`LoRABatch` applies a step's adapters to the rows that use them (rows of
different adapters and rows without one in one step): the base matmul runs once for
the whole batch, the low-rank part per adapter over its rows — inside the fused
native stack (``ember/kernels/lora_delta.h``, batch invariant) where the model runs
one, op by op in PyTorch (the oracle) elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.errors import EmberError
from ember.models.config import ModelConfig
from ember.models.gguf import GGUFFile
from ember.models.linear import load_dense

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PEFT_MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                "down_proj": "ffn_down"}
DEFAULT_MAX_RANK = 64
DEFAULT_MAX_LORAS = 8
log = logging.getLogger("ember.lora")


class LoRAError(EmberError):
    """An adapter file that cannot be used with the served model (the message names
    what does not fit)."""


# The fused projections of a decoder layer, in the native stack's order
# (ember/kernels/lora_delta.h): each target adds to some of one's output columns.
FUSED = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LoRADelta:
    a: torch.Tensor  # (rank, in), f32 or bf16
    bt: torch.Tensor  # (rank, out): B transposed, the scale folded in, as ``a``
    fused: int  # the fused projection (index in FUSED) the target is part of
    lo: int  # its first output column there


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    identity: bytes  # sha256 of the adapter's file bytes
    rank: int  # the largest of its deltas'
    deltas: dict[tuple[int, str], LoRADelta]  # (layer, target) -> delta

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.bt.nbytes for d in self.deltas.values())

    @property
    def targets(self) -> list[str]:
        return sorted({t for _, t in self.deltas}, key=TARGETS.index)

    def on(self, layer: int, fused: int) -> list[LoRADelta]:
        """The deltas on one fused projection of ``layer``."""
        by = self.__dict__.get("_by_fused")
        if by is None:
            by = self.__dict__["_by_fused"] = {}
            for (i, _), d in self.deltas.items():
                by.setdefault((i, d.fused), []).append(d)
        return by.get((layer, fused), [])

    def native(self, stack: Any) -> Any:
        """The adapter as the native ``stack``'s ``LoRAWeights`` (made once per stack;
        it shares the tensors)."""
        made = self.__dict__.setdefault("_native", {})
        if id(stack) not in made:
            weights = stack.new_lora()
            for (layer, _), d in self.deltas.items():
                weights.set(layer, d.fused, d.lo, d.a, d.bt)
            made[id(stack)] = (stack, weights)  # the stack held: its id stays its own
        return made[id(stack)][1]


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may target."""
    q, kv, h, f = cfg.n_heads * cfg.head_dim, cfg.kv_dim, cfg.hidden_size, cfg.ffn_size
    return {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}


def fused_columns(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's fused projection (index in FUSED) and first output column there."""
    q, kv, f = cfg.n_heads * cfg.head_dim, cfg.kv_dim, cfg.ffn_size
    return {"attn_q": (0, 0), "attn_k": (0, q), "attn_v": (0, q + kv), "attn_output": (1, 0),
            "ffn_gate": (2, 0), "ffn_up": (2, f), "ffn_down": (3, 0)}


ATTENTION_TARGETS = TARGETS[:4]


def check_base(cfg: ModelConfig) -> None:
    """Refuse a base model whose projections adapters cannot address yet (a model with
    routed experts takes adapters on its attention projections only: load_lora)."""
    why = ("recurrent layers" if cfg.recurrent
           else "a gated attention output" if cfg.attn_output_gate else None)
    if why:
        raise LoRAError(f"LoRA adapters are not supported for models with {why} "
                        f"({cfg.architecture})")


LORA_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def load_lora(path: str | Path, name: str, cfg: ModelConfig,
              max_rank: int = DEFAULT_MAX_RANK, dtype: str = "f32") -> LoRAAdapter:
    """The adapter at ``path`` (a GGUF file or a PEFT directory), checked against the
    base model's configuration ``cfg``, held in ``dtype`` (a name in LORA_DTYPES)."""
    held = LORA_DTYPES[dtype]
    check_base(cfg)
    p = Path(path)
    try:
        is_dir = stat.S_ISDIR(p.stat().st_mode)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {name!r}: {p} does not exist") from None
    except OSError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {p} cannot be read ({e.strerror})") from None
    limit = max_adapter_bytes(cfg, max_rank)
    raw, identity = _peft(p, cfg, limit) if is_dir else _gguf(p, cfg, limit)
    shapes, columns = projection_shapes(cfg), fused_columns(cfg)
    deltas, rank = {}, 0
    for (layer, target), (a, b, scale) in raw.items():
        where = f"LoRA adapter {name!r}: blk.{layer}.{target}"
        if target not in shapes:
            raise LoRAError(f"{where}: target module {target!r} is not supported "
                            f"(supported: {', '.join(TARGETS)})")
        if not 0 <= layer < cfg.n_layers:
            raise LoRAError(f"{where}: the base model has {cfg.n_layers} layers")
        if cfg.n_experts and target not in ATTENTION_TARGETS:
            raise LoRAError(f"{where}: the base model's feed-forward layers are routed "
                            f"experts; adapters on it may target {', '.join(ATTENTION_TARGETS)}"
                            " only")
        out, inp = shapes[target]
        r = a.shape[0]
        if a.shape != (r, inp) or b.shape != (out, r):
            raise LoRAError(f"{where}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do "
                            f"not fit the base projection ({out} x {inp}): another base model?")
        if r > max_rank:
            raise LoRAError(f"{where}: rank {r} is above max_lora_rank {max_rank}")
        for part, value in (("lora_a", a), ("lora_b", b), ("scale (alpha)", torch.tensor(scale))):
            if not bool(torch.isfinite(value).all()):
                raise LoRAError(f"{where}: {part} holds non-finite values (NaN or infinity)")
        rank = max(rank, r)
        deltas[(layer, target)] = LoRADelta(a.to(held).contiguous(),
                                            (b.float() * scale).T.to(held).contiguous(),
                                            *columns[target])
    if not deltas:
        raise LoRAError(f"LoRA adapter {name!r}: {p} holds no LoRA tensors")
    return LoRAAdapter(name, p, identity, rank, deltas)


def max_adapter_bytes(cfg: ModelConfig, max_rank: int) -> int:
    """The largest file an adapter of rank ``max_rank`` on every supported projection of
    every layer of this base can be (f32 tensors, plus room for its header)."""
    per_layer = sum(out + inp for out, inp in projection_shapes(cfg).values())
    return 4 * max_rank * per_layer * cfg.n_layers + (16 << 20)


def _regular_file(path: Path, max_bytes: int) -> None:
    """Refuse, before anything opens it, what is not a regular file — a FIFO blocks the
    open, /dev/zero never ends — or is larger than any adapter this base can take."""
    try:
        st = path.stat()
    except OSError as e:
        raise LoRAError(f"{path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise LoRAError(f"{path}: not a regular file")
    if st.st_size > max_bytes:
        raise LoRAError(f"{path}: {st.st_size} bytes, more than an adapter of this base "
                        f"model can be ({max_bytes})")


# ------------------------------------------------------------------ GGUF adapters
def _gguf(path: Path, cfg: ModelConfig, max_bytes: int
          ) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]], bytes]:
    _regular_file(path, max_bytes)
    identity = _file_hash([path])
    try:
        g = GGUFFile(path)
    except EmberError as e:
        raise LoRAError(f"{path.name}: not a readable GGUF adapter: {e}") from None
    with g:
        kind = g.metadata.get("general.type")
        if kind != "adapter" or g.metadata.get("adapter.type") != "lora":
            raise LoRAError(f"{path.name}: general.type {kind!r} / adapter.type "
                            f"{g.metadata.get('adapter.type')!r} is not a LoRA adapter")
        if g.architecture != cfg.architecture:
            raise LoRAError(f"{path.name}: adapter for architecture {g.architecture!r}, "
                            f"the base model is {cfg.architecture!r}")
        alpha = _number(path, "adapter.lora.alpha", g.metadata.get("adapter.lora.alpha", 0.0))
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for tensor in g.tensors:
            base, _, part = tensor.rpartition(".")
            if part not in ("lora_a", "lora_b"):
                raise LoRAError(f"{path.name}: tensor {tensor!r} is not a LoRA tensor")
            pairs.setdefault(base, {})[part] = load_dense(g, tensor)
    raw = {}
    for base, parts in pairs.items():
        if set(parts) != {"lora_a", "lora_b"}:
            raise LoRAError(f"{path.name}: {base} has {sorted(parts)} but needs lora_a and "
                            "lora_b")
        layer, target = _gguf_target(path, base)
        a, b = parts["lora_a"], parts["lora_b"]
        if a.dim() != 2 or b.dim() != 2 or not a.shape[0]:
            raise LoRAError(f"{path.name}: {base}: lora_a {tuple(a.shape)} / lora_b "
                            f"{tuple(b.shape)} are not matrices of a rank of at least 1")
        raw[(layer, target)] = (a, b, alpha / a.shape[0] if alpha else 1.0)
    return raw, identity


def _gguf_target(path: Path, name: str) -> tuple[int, str]:
    pieces = name.split(".")
    if len(pieces) != 4 or pieces[0] != "blk" or not pieces[1].isdigit() \
            or pieces[3] != "weight":
        raise LoRAError(f"{path.name}: tensor {name!r}: target module not supported "
                        f"(supported: blk.N.<{'|'.join(TARGETS)}>.weight)")
    return int(pieces[1]), pieces[2]


# ------------------------------------------------------------------ PEFT directories
def _peft(path: Path, cfg: ModelConfig, max_bytes: int
          ) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]], bytes]:
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f, limit in ((config_file, 1 << 20), (weights_file, max_bytes)):
        if not f.exists():
            raise LoRAError(f"{path}: a PEFT adapter directory needs {f.name}")
        _regular_file(f, limit)
    identity = _file_hash([config_file, weights_file])
    try:
        config = json.loads(config_file.read_bytes())
    except ValueError as e:
        raise LoRAError(f"{config_file}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{config_file}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise LoRAError(f"{config_file}: {flag} is not supported")
    tensors = _read_safetensors(weights_file)
    alpha = _number(config_file, "lora_alpha", config.get("lora_alpha", 8))
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise LoRAError(f"{config_file}: alpha_pattern is not an object")
    rslora = bool(config.get("use_rslora"))
    raw = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise LoRAError(f"{weights_file.name}: tensor {key!r} is not a LoRA tensor "
                                "(modules_to_save and embedding adapters are not supported)")
            continue
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in tensors:
            raise LoRAError(f"{weights_file.name}: {key} has no {b_key}")
        layer, module = _peft_target(weights_file, key)
        target = PEFT_MODULES.get(module)
        if target is None:
            raise LoRAError(f"{weights_file.name}: target module {module!r} is not supported "
                            f"(supported: {', '.join(PEFT_MODULES)})")
        if a.dim() != 2 or tensors[b_key].dim() != 2 or not a.shape[0]:
            raise LoRAError(f"{weights_file.name}: {key} and {b_key} must be matrices, "
                            f"not of shapes {tuple(a.shape)} / {tuple(tensors[b_key].shape)}")
        r = a.shape[0]
        a_alpha = _number(config_file, "alpha_pattern", next(
            (v for k, v in patterns.items() if key.find(k) >= 0), alpha))
        scale = a_alpha / (math.sqrt(r) if rslora else r)
        raw[(layer, target)] = (a, _as_gguf_rows(tensors[b_key], target, cfg), scale)
    return raw, identity


def _number(f: Path, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LoRAError(f"{f}: {field} {value!r} is not a number")
    return float(value)


def _peft_target(f: Path, key: str) -> tuple[int, str]:
    pieces = key.split(".")
    try:
        at = pieces.index("layers")
        return int(pieces[at + 1]), pieces[pieces.index("lora_A") - 1]
    except (ValueError, IndexError):
        raise LoRAError(f"{f.name}: tensor {key!r}: no layer index in its name") from None


def _as_gguf_rows(b: torch.Tensor, target: str, cfg: ModelConfig) -> torch.Tensor:
    """``B``'s rows in the GGUF's order: llama.cpp's converter permutes q and k rows of
    a llama-layout model (adjacent-pair RoPE) so that each head's pairs sit together."""
    if cfg.rope_neox or target not in ("attn_q", "attn_k"):
        return b
    heads = cfg.n_heads if target == "attn_q" else cfg.n_kv_heads
    if b.dim() != 2 or b.shape[0] % (2 * heads):
        return b  # not this base's projection: refused by its shape check
    return (b.reshape(heads, 2, b.shape[0] // heads // 2, *b.shape[1:])
            .swapaxes(1, 2).reshape(b.shape))


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (the format: an 8-byte header length, a JSON header
    of dtype/shape/offsets, then the bytes), as float32. Every length, shape and offset
    is checked against the file before anything is read or allocated."""
    data = path.read_bytes()
    if len(data) < 8:
        raise LoRAError(f"{path.name}: not a safetensors file: {len(data)} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise LoRAError(f"{path.name}: not a safetensors file: its header length {n} "
                        f"passes the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise LoRAError(f"{path.name}: not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise LoRAError(f"{path.name}: not a safetensors file: its header is not an object")
    body = memoryview(data)[8 + n:]
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        out[key] = _safetensor(path, key, info, body)
    return out


def _safetensor(path: Path, key: str, info: Any, body: memoryview) -> torch.Tensor:
    where = f"{path.name}: {key}"
    if not isinstance(info, dict):
        raise LoRAError(f"{where}: its header entry is not an object")
    dtype = _SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"),
                                                                    str) else None
    if dtype is None:
        raise LoRAError(f"{where}: dtype {info.get('dtype')!r} is not supported")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise LoRAError(f"{where}: shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= len(body)):
        raise LoRAError(f"{where}: data_offsets {offsets!r} are not within the file's "
                        f"{len(body)} data bytes")
    count = math.prod(shape)
    if count * np.dtype(dtype).itemsize != offsets[1] - offsets[0]:
        raise LoRAError(f"{where}: shape {shape} needs {count * np.dtype(dtype).itemsize} "
                        f"bytes, its offsets hold {offsets[1] - offsets[0]}")
    arr = np.frombuffer(body[offsets[0]:offsets[1]], dtype=dtype).reshape(shape)
    t = torch.from_numpy(arr.copy())
    if info["dtype"] == "BF16":
        t = (t.to(torch.int32) << 16).view(torch.float32)
    return t.float()


def _file_hash(files: Sequence[Path]) -> bytes:
    """sha256 of the files' bytes, each read only as far as the size it had when checked
    (opened without blocking and checked again: a FIFO swapped in reads as nothing)."""
    h = hashlib.sha256()
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LoRAError(f"{f}: not a regular file")
            left = st.st_size
            while left > 0:
                chunk = fh.read(min(left, 1 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
    return h.digest()


# ------------------------------------------------------------------ PEFT -> GGUF
def peft_to_gguf(peft_dir: str | Path, cfg: ModelConfig, out: str | Path) -> Path:
    """Write the PEFT adapter at ``peft_dir`` as a llama.cpp GGUF adapter (f32), as
    ``convert_lora_to_gguf.py`` does: B's q/k rows in the GGUF's order, one
    ``adapter.lora.alpha`` (so every module must scale by alpha / its rank)."""
    from ember.models.gguf import TensorToWrite, write_gguf

    check_base(cfg)
    # (no rank is above the hidden size: a wider one adds nothing a full one would not)
    raw, _ = _peft(Path(peft_dir), cfg, max_adapter_bytes(cfg, cfg.hidden_size))
    alphas = {round(scale * a.shape[0], 6) for a, _, scale in raw.values()}
    if len(alphas) != 1:
        raise LoRAError(f"{peft_dir}: modules scale differently (alpha_pattern or "
                        "rsLoRA): a GGUF adapter holds one alpha")
    tensors = []
    for (layer, target), (a, b, _) in sorted(raw.items()):
        for part, t in (("lora_a", a), ("lora_b", b)):
            arr = np.ascontiguousarray(t.float().numpy())
            tensors.append(TensorToWrite(f"blk.{layer}.{target}.weight.{part}",
                                         tuple(arr.shape), 0, lambda arr=arr: [arr]))
    metadata = {"general.architecture": cfg.architecture, "general.type": "adapter",
                "adapter.type": "lora", "adapter.lora.alpha": float(alphas.pop())}
    path = Path(out)
    with open(path, "wb") as f:
        write_gguf(f, metadata, tensors)
    return path


# ------------------------------------------------------------------ applying them
class LoRABatch:
    """One step's adapters and the flat token positions of the rows using each."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]]) -> None:
        self.groups = groups

    @classmethod
    def of_rows(cls, adapters: Sequence[LoRAAdapter | None], lengths: Sequence[int]
                ) -> LoRABatch | None:
        """The batch of rows with ``adapters`` (None: the base) of ``lengths`` tokens,
        in order; None when no row has one."""
        by: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        offset = 0
        for adapter, n in zip(adapters, lengths, strict=True):
            if adapter is not None:
                by.setdefault(id(adapter), (adapter, []))[1].extend(range(offset, offset + n))
            offset += n
        if not by:
            return None
        return cls([(a, torch.tensor(idx, dtype=torch.long)) for a, idx in by.values()])

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the ``fused`` projection of ``x`` in ``layer``, a name in FUSED) plus
        each row's adapter deltas."""
        which = FUSED.index(fused)
        for adapter, index in self.groups:
            deltas = adapter.on(layer, which)
            if not deltas:
                continue
            xs = x[index]
            for d in deltas:
                y[index, d.lo:d.lo + d.bt.shape[1]] += (xs @ d.a.float().T) @ d.bt.float()
        return y

    def native(self, stack: Any, tokens: int) -> tuple[list[Any], torch.Tensor]:
        """The native ``stack``'s arguments: the adapters' ``LoRAWeights`` and the one
        each of the step's ``tokens`` uses (-1: none)."""
        which = torch.full((tokens,), -1, dtype=torch.long)
        for g, (_, index) in enumerate(self.groups):
            which[index] = g
        return [adapter.native(stack) for adapter, _ in self.groups], which
