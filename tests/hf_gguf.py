"""transformers' model of a GGUF, the oracle of the logits tests, loaded quickly.

transformers reads a GGUF with gguf-py, which parses every metadata value in pure
Python twice (config, then weights): a 49k-entry vocabulary costs ~10 s, Gemma 3's
262k ~45 s, none of which the model needs. The oracle reads a copy without the
vocabulary arrays (its size said by ``{arch}.vocab_size``, a key transformers maps);
hyperparameters and tensor bytes are the original's, so what transformers builds is
the same model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.models.gguf import GGMLType, GGUFFile, TensorToWrite, write_gguf

VOCABULARY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def rewrite_gguf(src: Path, dst: Path, drop_tensors: tuple[str, ...] = (),
                 drop_keys: tuple[str, ...] = (), add_keys: dict[str, Any] | None = None,
                 q8_0: bool = False, mxfp4_experts: bool = False) -> Path:
    """A copy of ``src`` without some tensors or metadata keys — a file as a broken
    converter or a hand edit would leave it — with ``add_keys`` set, or (``q8_0``) with
    its f32 matrices (and routed experts) quantized to Q8_0 by gguf-py, as the converter's
    ``--outtype q8_0`` does, or (``mxfp4_experts``) its routed
    experts' f32 weights to MXFP4, as gpt-oss ships them. Read by ember's parser (fast: it
    parses a vocabulary in bulk) and written by ember's writer; numeric arrays keep
    their item types, scalars take the writer's (``write_gguf``)."""
    import gguf as gguf_py

    q8 = gguf_py.GGMLQuantizationType.Q8_0
    mxfp4 = gguf_py.GGMLQuantizationType.MXFP4
    with GGUFFile(src) as g:
        metadata = {k: v for k, v in g.metadata.items() if k not in drop_keys}
        metadata.update(add_keys or {})
        tensors = []
        for t in g.tensors.values():
            if t.name in drop_tensors:
                continue
            if mxfp4_experts and t.ggml_type == GGMLType.F32 and len(t.shape) == 3 \
                    and t.name.endswith("_exps.weight"):
                data = g.tensor_bytes(t.name).view(np.float32).reshape(-1, t.shape[-1])
                tensors.append(TensorToWrite(t.name, t.shape, int(mxfp4),
                               lambda d=data: [gguf_py.quants.quantize(d, mxfp4)]))
            elif q8_0 and t.ggml_type == GGMLType.F32 and t.shape[-1] % 32 == 0 and (
                    len(t.shape) == 2 or t.name.endswith("_exps.weight")):
                data = g.tensor_bytes(t.name).view(np.float32).reshape(-1, t.shape[-1])
                tensors.append(TensorToWrite(t.name, t.shape, int(q8),
                               lambda d=data: [gguf_py.quants.quantize(d, q8)]))
            else:
                tensors.append(TensorToWrite(t.name, t.shape, t.ggml_type,
                                             lambda name=t.name: [g.tensor_bytes(name)]))
        partial = dst.with_suffix(f".{os.getpid()}.tmp")
        with open(partial, "wb") as f:
            write_gguf(f, metadata, tensors)
        partial.replace(dst)
    return dst


def without_vocabulary(src: Path) -> Path:
    """A copy of ``src`` without its vocabulary arrays (made once per file version)."""
    st = src.stat()
    out_dir = Path(tempfile.gettempdir()) / f"ember-hf-weights-{os.getuid()}"
    out_dir.mkdir(exist_ok=True)
    dst = out_dir / f"{src.stem}-{st.st_size}-{st.st_mtime_ns}.gguf"
    if dst.exists():
        return dst
    with GGUFFile(src) as g:
        vocab = {f"{g.architecture}.vocab_size": g.tensor("token_embd.weight").shape[0]}
    return rewrite_gguf(src, dst, drop_keys=VOCABULARY_ARRAYS, add_keys=vocab)


def transformers_from_gguf(path: Path, **config: Any) -> torch.nn.Module:
    """transformers' float32 model of the GGUF at ``path`` (``config``: fields its GGUF
    reader does not map), in eval mode."""
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    weights = without_vocabulary(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(weights.parent), gguf_file=weights.name, dtype=torch.float32,
        local_files_only=True, **config).eval()
