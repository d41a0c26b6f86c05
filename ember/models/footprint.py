"""How many bytes a loaded model's weights hold, and how many a decode step reads.

One walk over a :class:`~ember.models.decoder.DecoderModel` gives both:

- :func:`weight_bytes`: what the weights keep in memory — every layer's linears, norm
  vectors and biases, MoE routers and the experts built so far, the final norm, the
  output head, and the embedding table where it is resident on its own (a dense
  table; a table tied to a packed head shares the head's bytes; a quantized table
  read row by row from the file mapping holds none). The engine logs it at startup.
- :func:`step_weight_bytes`: what a one-token decode step reads — the same without the
  embedding (a step looks up one row per token), and of the routed experts only the
  ``k`` each layer routes the token to. ``ember bench compare`` sets it against
  llama.cpp's bytes per step and the memory bandwidth.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch


def _parts(model: Any) -> dict[str, int]:
    """Bytes by part: ``step`` (read in full every step), ``embedding``, ``experts`` (all
    built), ``routed`` (the experts one token reads: k per layer)."""
    from ember.models.linear import linear_nbytes
    from ember.models.moe import MoEFeedForward

    if hasattr(model, "footprint_parts"):  # a model that is not a decoder (an encoder)
        return model.footprint_parts()
    step = model.output_norm.nbytes + linear_nbytes(model.output)
    routed = 0
    for layer in model.layers:  # every kind of layer: its tensors, linears and router
        for part in dataclasses.fields(layer):
            value = getattr(layer, part.name)
            if isinstance(value, torch.Tensor):
                step += value.nbytes
            elif isinstance(value, MoEFeedForward):
                step += value.router.nbytes
                routed += value.top_k * value.store.expert_nbytes(value.layer)
                if value.shared is not None:
                    step += value.shared.gate.nbytes + sum(
                        linear_nbytes(x) for x in (value.shared.gate_up, value.shared.down))
            elif hasattr(value, "out_features"):
                step += linear_nbytes(value)
    table = getattr(model.embed, "weight", None)  # dense tables only: see the module doc
    head = getattr(model.output, "weight", None)
    shared = (isinstance(table, torch.Tensor) and isinstance(head, torch.Tensor)
              and table.untyped_storage().data_ptr() == head.untyped_storage().data_ptr())
    embedding = table.nbytes if isinstance(table, torch.Tensor) and not shared else 0
    experts = model.experts.cached_bytes if model.experts is not None else 0
    return {"step": step, "embedding": embedding, "experts": experts, "routed": routed}


def weight_bytes(model: Any) -> int:
    """Bytes the model's weights hold in memory (see the module doc)."""
    parts = _parts(model)
    return parts["step"] + parts["embedding"] + parts["experts"]


def step_weight_bytes(model: Any) -> int:
    """Weight bytes a one-token decode step reads: every layer's linears and norm
    vectors, the k experts it routes to in each routed layer, the final norm and the
    output head (not the embedding table)."""
    parts = _parts(model)
    return parts["step"] + parts["routed"]


def process_rss() -> int | None:
    """The process's resident set size in bytes now (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_summary(model: Any, kv_pool_bytes: int, kv_bytes_per_token: int,
                   kv_dtype: str) -> str:
    """The engine's startup line: weights, the KV pool's maximum (it is allocated
    untouched, so its pages are resident only once used) and the runtime — the process
    RSS now minus the weights (the interpreter, torch, the tokenizer, buffers)."""
    weights = weight_bytes(model)
    line = (f"memory: weights {weights / 1e6:.1f} MB, KV pool up to "
            f"{kv_pool_bytes / 2**20:.1f} MiB ({kv_bytes_per_token / 1024:.1f} KiB/token, "
            f"{kv_dtype})")
    rss = process_rss()
    if rss is not None:
        line += f", runtime {(rss - weights) / 1e6:.1f} MB (process RSS {rss / 1e6:.1f} MB)"
    return line
