"""``ember inspect MODEL``: what ember makes of a GGUF, without loading its weights.

The first thing to run on a new file: its architecture and the options its family
switches on, the tokenizer, the tensor formats and which of them run natively (a
packed layout for the q4 kernels, or dense f32 op by op), whether the fused native
stack takes the model, what the chat template can do (system, tools, calls, thinking)
and in which format the model writes tool calls, and the KV cache's bytes per token in
each KV dtype. Every part is tried as loading would try it, and a part ember refuses
says why (the same message loading would give) instead of failing the whole report.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from ember.chat_template import ChatTemplate
from ember.errors import EmberError
from ember.kv.dtypes import KV_DTYPES
from ember.models.architectures import ARCHITECTURES, model_config
from ember.models.config import ModelConfig
from ember.models.decoder import native_stack_supports
from ember.models.gguf import GGMLType, GGUFFile
from ember.models.linear import PACKED_TYPES
from ember.models.quant import SUPPORTED_TYPES
from ember.tokenizer import Tokenizer
from ember.tool_formats import tool_style

_DEFAULTS = ModelConfig("", 0, 0, 0, 0, 0, 0, 0, 0.0, 1.0, 0.0, 0, 0, False)
_SHAPE = ("architecture", "n_layers", "hidden_size", "ffn_size", "n_heads", "n_kv_heads",
          "head_dim", "rope_dim", "rope_base", "rope_scale", "norm_eps", "vocab_size",
          "context_length", "tied_embeddings")


def inspect_gguf(gguf: GGUFFile) -> dict[str, Any]:
    """The report as plain data (``ember inspect --json`` prints it)."""
    report: dict[str, Any] = {"file": str(gguf.path), "bytes": gguf.path.stat().st_size,
                              "name": gguf.metadata.get("general.name"),
                              "architecture": gguf.architecture}
    config = _attempt(report, "model", lambda: model_config(gguf))
    if config is not None:
        report["model"] = _model(config)
        report["kv_bytes_per_token"] = {
            name: 2 * len(config.kv_layers) * config.n_kv_heads * d.row_bytes(config.head_dim)
            for name, d in KV_DTYPES.items() if d.fits(config.head_dim)}
        if config.delta_net is not None:  # recurrent layers: a fixed state per sequence
            report["state_bytes_per_sequence"] = config.state_bytes_per_sequence
    report["tensors"] = _tensors(gguf)
    report["native"] = _native(config, report["tensors"])
    tokenizer = _attempt(report, "tokenizer", lambda: Tokenizer.from_gguf(gguf))
    if tokenizer is not None:
        report["tokenizer"] = {
            "model": tokenizer.model, "pre": gguf.metadata.get("tokenizer.ggml.pre"),
            "vocab_size": tokenizer.vocab_size, "add_bos": tokenizer.add_bos,
            "bos": _text(tokenizer, tokenizer.bos_id), "eos": _text(tokenizer, tokenizer.eos_id)}
    report["chat_template"] = _template(gguf, config)
    return report


def _attempt(report: dict[str, Any], key: str, build: Any) -> Any:
    try:
        return build()
    except EmberError as e:
        report[key] = {"refused": str(e)}
        return None


def _model(config: ModelConfig) -> dict[str, Any]:
    shape = {name: getattr(config, name) for name in _SHAPE}
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if f.name not in _SHAPE and getattr(config, f.name) != getattr(_DEFAULTS, f.name)}
    if "layers" in options:  # per-layer attention kinds, as counts
        kinds = Counter(
            f"{'window ' + str(k.window) if k.window else 'global'}"
            f"{'' if k.rope else ', no RoPE'}, RoPE base {k.rope_base:g}" for k in config.layers)
        options["layers"] = dict(kinds)
    return {**shape, "options": options}


def _tensors(gguf: GGUFFile) -> dict[str, Any]:
    by_type: dict[str, dict[str, Any]] = {}
    for info in gguf.tensors.values():
        entry = by_type.setdefault(info.type_name, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += info.nbytes
    for name, entry in by_type.items():
        kind = GGMLType[name] if name in GGMLType.__members__ else None
        entry["runs"] = ("refused at load" if kind not in SUPPORTED_TYPES else
                         "packed, native kernels" if kind in PACKED_TYPES else
                         "f32 as stored (norms, biases; a matrix op by op)"
                         if kind == GGMLType.F32 else "dense f32 (op by op)")
    return by_type


def _native(config: ModelConfig | None, tensors: dict[str, Any]) -> dict[str, Any]:
    if config is None:
        return {"fused_stack": False, "why": "the architecture is refused"}
    if not native_stack_supports(config):
        return {"fused_stack": False,
                "why": f"the {config.activation} activation runs op by op"}
    dense = sorted(t for t, e in tensors.items()
                   if e["runs"] != "packed, native kernels" and t != "F32")
    if dense:
        return {"fused_stack": False, "why": f"{', '.join(dense)} tensors have no packed "
                "layout (F32/F16/BF16 and these run op by op)"}
    routed = " (routed experts too, grouped per expert)" if config.n_experts else ""
    if config.recurrent:
        routed += " (recurrent layers too, each row's scan token by token)"
    return {"fused_stack": True, "why": "every block option of the family and every "
            f"matrix type runs in one native call per step{routed} (with --weights q4)"}


def _text(tokenizer: Tokenizer, token: int | None) -> str | None:
    return None if token is None else tokenizer.token_bytes(token).decode("utf-8", "replace")


def _template(gguf: GGUFFile, config: ModelConfig | None) -> dict[str, Any]:
    family = ARCHITECTURES.get(gguf.architecture)
    default = family.chat_template if family is not None else None
    source = "gguf" if "tokenizer.chat_template" in gguf.metadata else (
        "family default" if default else None)
    if source is None:
        return {"source": None, "note": "none: raw completions only (or --chat-template)"}
    try:
        template = ChatTemplate.from_gguf(gguf, default=default)
        caps = template.caps
        style = tool_style(template)
    except EmberError as e:
        return {"source": source, "refused": str(e)}
    return {"source": source, **dataclasses.asdict(caps),
            "tool_format": style.fmt.name if style.native else "hermes (described by ember)"}


def format_report(report: dict[str, Any]) -> str:
    """The report as text, a section per part."""
    lines = [f"{report['file']}  ({report['bytes'] / 2**20:.1f} MiB)",
             f"  name: {report.get('name')}  architecture: {report['architecture']}"]
    model = report.get("model", {})
    if "refused" in model:
        lines.append(f"  model: REFUSED — {model['refused']}")
    elif model:
        lines.append("  model: " + ", ".join(f"{k} {model[k]}" for k in _SHAPE[1:]))
        for k, v in model["options"].items():
            lines.append(f"    {k}: {v}")
    lines.append("tensors:")
    for name, e in sorted(report["tensors"].items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"  {name:8s} {e['count']:5d} tensors {e['bytes'] / 2**20:10.1f} MiB"
                     f"  {e['runs']}")
    native = report["native"]
    lines.append(f"fused native stack: {'yes' if native['fused_stack'] else 'no'} "
                 f"({native['why']})")
    tok = report.get("tokenizer", {})
    lines.append("tokenizer: " + (f"REFUSED — {tok['refused']}" if "refused" in tok else
                                  ", ".join(f"{k} {v!r}" for k, v in tok.items())))
    tpl = report["chat_template"]
    lines.append("chat template: " + ", ".join(f"{k} {v}" for k, v in tpl.items()))
    if "kv_bytes_per_token" in report:
        lines.append("KV cache per token: " + ", ".join(
            f"{k} {v / 1024:.1f} KiB" for k, v in report["kv_bytes_per_token"].items()))
    if "state_bytes_per_sequence" in report:
        lines.append(f"recurrent state per sequence: "
                     f"{report['state_bytes_per_sequence'] / 2**20:.2f} MiB (f32; each "
                     "prefix-cache snapshot of it as much, --state-snapshot-bytes; and "
                     "one more per sequence while speculation is on)")
    return "\n".join(lines)
