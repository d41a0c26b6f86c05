"""``ember eval`` (ember.eval): its figures against direct computations on the tiny
model, and the engine refusing a pair whose recorded drift crosses the limits."""

from __future__ import annotations

import math

import pytest
import torch

from ember import eval as ember_eval
from ember.config import EngineConfig, InvalidConfig
from ember.engine.engine import LLMEngine

TEXT = ("The river runs through the old city, past the market and the library, under "
        "seven stone bridges, and out to the harbor where the fishing boats wait. ") * 3


def direct(loaded, window: int, kv_dtype: torch.dtype):
    """Perplexity, mean KL and top-1 vs f32 KV, computed here from model.score."""
    ids = loaded.encode_prompt(TEXT)
    nll = kl = agree = n = 0.0
    for chunk in ember_eval.windows(ids, window):
        ref = torch.log_softmax(loaded.model.score(chunk)[:-1].double(), -1)
        got = torch.log_softmax(loaded.model.score(chunk, kv_dtype=kv_dtype)[:-1].double(), -1)
        for i, t in enumerate(chunk[1:]):
            nll -= float(got[i, t])
            kl += float((ref[i].exp() * (ref[i] - got[i])).sum())
            agree += int(got[i].argmax() == ref[i].argmax())
            n += 1
    return math.exp(nll / n), kl / n, agree / n, int(n)


def test_figures_equal_a_direct_computation(tiny_gguf, tiny_loaded):
    rows = ember_eval.measure(str(tiny_gguf), ["f32"], ["f32", "bf16"], window=24,
                              decode_tokens=0, text=TEXT)
    same, bf16 = rows
    ppl, kl, top1, n = direct(tiny_loaded, 24, torch.float32)
    assert same.tokens == n and same.kl == 0 and same.top1 == 1 and same.max_drift == 0
    assert same.perplexity == pytest.approx(ppl, rel=1e-5)
    ppl, kl, top1, n = direct(tiny_loaded, 24, torch.bfloat16)
    assert bf16.perplexity == pytest.approx(ppl, rel=1e-5)
    assert bf16.kl == pytest.approx(kl, rel=1e-3, abs=1e-9) and bf16.kl > 0
    assert bf16.top1 == pytest.approx(top1)
    assert same.bytes_per_weight == 4.0


def test_a_recorded_drift_beyond_the_limits_is_refused_by_name(tiny_gguf, tiny_loaded,
                                                               tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    sha = ember_eval.model_sha(tiny_loaded)

    def engine(**options) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_gguf), weights="f32", num_kv_blocks=16,
                                      **options), loaded=tiny_loaded)

    engine(kv_dtype="bf16")  # never measured: allowed
    good = ember_eval.Drift("f32", "f16", 100, 30.0, 0.001, 0.99, 0.1, 4.0)
    bad = ember_eval.Drift("f32", "bf16", 100, 31.0, 0.2, 0.8, 5.0, 4.0)
    ember_eval.record(sha, [good, bad])
    engine(kv_dtype="f16")
    with pytest.raises(InvalidConfig, match=r"KL 0\.2000 \(limit 0\.05\).*80\.0%.*--allow-drift"):
        engine(kv_dtype="bf16")
    engine(kv_dtype="bf16", allow_drift=True)


def test_the_shipped_measurements_are_within_the_limits_for_the_default_formats():
    import json

    shipped = json.loads(ember_eval.SHIPPED.read_text())
    assert shipped, "ember/data/validation.json is empty"
    for key, m in shipped.items():
        if m["weights"] in ("f32", "bf16", "q4") and m["kv_dtype"] in ("f32", "f16"):
            assert m["kl"] <= ember_eval.MAX_KL and m["top1"] >= ember_eval.MIN_TOP1, key
