"""``ember eval``: how far each weight format and KV dtype drifts from the f32 reference.

Quantization is a validation problem: a format is usable when its measured drift on
real text is small, not because it loads. The text is ``ember/data/eval_text.txt``
(public-domain prose, ~2,600 SmolLM2 tokens), scored by teacher forcing in windows of
``window`` tokens, each from its start. For every (weight format, KV dtype) pair:

- perplexity: exp of the mean negative log-likelihood of each next token;
- KL: mean over positions of KL(reference ‖ format) of the next-token distributions;
- top-1: the share of positions whose most likely token equals the reference's;
- max drift: the largest |logit − reference logit| over every position and token;
- bytes per weight of the layers' linear maps (the bulk of a decode step's reads);
- decode tok/s: one greedy stream of ``decode_tokens`` tokens after a short prompt.

The reference is ``f32`` weights with ``f32`` KV. Results are printed, written as
JSON and recorded in ``$EMBER_HOME/validation.json`` (by model checksum, format and KV
dtype), where an engine finds them (:mod:`ember.models.validation`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.linear import linear_nbytes
from ember.models.loader import load_model, physical_cores
from ember.models.validation import MAX_KL, MIN_TOP1, Drift, model_sha, record
from ember.sampling.params import SamplingParams

TEXT = Path(__file__).parent / "data" / "eval_text.txt"


class _Acc:
    """Running sums over windows for one (format, KV dtype) pair."""

    def __init__(self) -> None:
        self.n = 0
        self.nll = self.kl = 0.0
        self.agree = 0
        self.drift = 0.0

    def add(self, logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> None:
        logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
        self.n += targets.numel()
        self.nll -= float(logp.gather(1, targets[:, None]).sum())
        self.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        self.agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        self.drift = max(self.drift, float((logits - ref).abs().max()))


def linear_bytes_per_weight(model: Any) -> float:
    """Bytes per weight of the repeated layers' linear maps (qkv, o, gate/up, down)."""
    def size(lin: Any) -> tuple[int, int]:
        return linear_nbytes(lin), lin.out_features * lin.in_features

    total = [size(getattr(layer, n)) for layer in model.layers
             for n in ("qkv", "o", "gate_up", "down")]
    return sum(b for b, _ in total) / sum(w for _, w in total)


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]


def measure(model_name: str, weights: list[str], kv_dtypes: list[str], window: int = 512,
            decode_tokens: int = 64, text: str | None = None,
            reference: Any = None) -> list[Drift]:
    """The drift rows; ``reference`` is ``model_name`` loaded as f32, if the caller has it."""
    reference = reference or load_model(model_name, "f32")
    ids = reference.encode_prompt(text if text is not None else TEXT.read_text())
    loaded = {w: reference if w == "f32" else load_model(model_name, w) for w in weights}
    pairs = [(w, d) for w in weights for d in kv_dtypes]
    acc = {pair: _Acc() for pair in pairs}
    for chunk in windows(ids, window):
        ref = reference.model.score(chunk)[:-1].float()
        targets = torch.tensor(chunk[1:])
        for w, d in pairs:
            logits = loaded[w].model.score(chunk, kv_dtype=d)[:-1].float()
            acc[(w, d)].add(logits, ref, targets)
    out = []
    for (w, d), a in acc.items():
        out.append(Drift(w, d, a.n, math.exp(a.nll / a.n), a.kl / a.n, a.agree / a.n, a.drift,
                         linear_bytes_per_weight(loaded[w].model)))
        if decode_tokens:
            out[-1].decode_tok_s = decode_rate(loaded[w], d, decode_tokens)
    return out


def decode_rate(loaded: Any, kv_dtype: str, tokens: int) -> float:
    """Tokens/s of one greedy stream: (time for 1 + tokens) − (time for 1), over tokens."""
    engine = LLMEngine(EngineConfig(model=str(loaded.path), weights=loaded.weights,
                                    kv_dtype=kv_dtype, num_kv_blocks=64, speculation="off",
                                    enable_prefix_caching=False), loaded=loaded)
    prompt = loaded.encode_prompt("The old harbour at dawn, described in detail:")

    def seconds(n: int) -> float:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    seconds(tokens)  # warm-up
    best = min(seconds(1 + tokens) - seconds(1) for _ in range(2))
    return tokens / best if best > 0 else math.inf


def main(model: str, weights: list[str], kv_dtypes: list[str], window: int,
         decode_tokens: int, threads: int | None, out: Path) -> list[Drift]:
    torch.set_num_threads(threads or physical_cores())
    reference = load_model(model, "f32")
    rows = measure(model, weights, kv_dtypes, window, decode_tokens, reference=reference)
    path, sha = reference.path, model_sha(reference)
    print(f"{path.name}: {rows[0].tokens} positions of {TEXT.name}, windows of {window}, "
          f"{torch.get_num_threads()} threads; reference f32 weights + f32 KV")
    print(f"{'weights':<8}{'KV':<6}{'ppl':>9}{'KL':>10}{'top-1':>8}{'max drift':>11}"
          f"{'B/weight':>10}{'decode':>12}")
    for r in rows:
        bad = " (refused)" if r.kl > MAX_KL or r.top1 < MIN_TOP1 else ""
        rate = f"{r.decode_tok_s:.1f} tok/s" if r.decode_tok_s else "-"
        print(f"{r.weights:<8}{r.kv_dtype:<6}{r.perplexity:>9.3f}{r.kl:>10.5f}{r.top1:>8.1%}"
              f"{r.max_drift:>11.3f}{r.bytes_per_weight:>10.3f}{rate:>12}{bad}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": path.name, "sha256": sha, "window": window,
                               "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"wrote {out}; recorded in {record(sha, rows)}")
    return rows
