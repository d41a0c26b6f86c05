"""``ember eval`` (ember.eval): its figures against direct computations on the tiny
model, and the engine refusing a pair whose recorded drift crosses the limits."""

from __future__ import annotations

import math

import pytest
import torch

from ember import eval as ember_eval
from ember.config import EngineConfig, InvalidConfig
from ember.engine.engine import LLMEngine
from ember.models import validation

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
    sha = validation.model_sha(tiny_loaded)

    def engine(**options) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_gguf), weights="f32", num_kv_blocks=16,
                                      **options), loaded=tiny_loaded)

    engine(kv_dtype="bf16")  # never measured: allowed
    good = validation.Drift("f32", "f16", 100, 30.0, 0.001, 0.99, 0.1, 4.0)
    bad = validation.Drift("f32", "bf16", 100, 31.0, 0.2, 0.8, 5.0, 4.0)
    validation.record(sha, [good, bad])
    engine(kv_dtype="f16")
    with pytest.raises(InvalidConfig, match=r"KL 0\.2000 \(limit 0\.05\).*80\.0%.*--allow-drift"):
        engine(kv_dtype="bf16")
    engine(kv_dtype="bf16", allow_drift=True)


def test_the_shipped_measurements_cover_and_admit_every_format_of_the_bundled_models():
    """Every (weights, KV dtype) pair an engine can start with on a registered model is
    measured (the engine checks it at startup), and within the limits."""
    import json

    from ember.kv.dtypes import KV_DTYPES
    from ember.models.linear import WEIGHT_FORMATS
    from ember.models.registry import MODELS

    shipped = json.loads(validation.SHIPPED.read_text())
    for spec in MODELS.values():
        for w in WEIGHT_FORMATS:
            for d in KV_DTYPES:
                key = f"{spec.sha256}:{w}:{d}"
                assert key in shipped, f"{spec.alias}: weights {w}, KV {d} never measured"
                m = shipped[key]
                assert m["kl"] <= validation.MAX_KL and m["top1"] >= validation.MIN_TOP1, key
                assert validation.check_drift(spec.sha256, w, d) is None


@pytest.mark.slow
def test_q8_0_kv_drifts_little_from_f32_kv_on_smollm2(smollm2_llm):
    """f32 weights, so the KV dtype alone: q8_0 keeps the next-token distributions close
    to f32 KV's (measured on the whole text: KL 0.0005, top-1 98.9%), f16 closer still."""
    text = ember_eval.TEXT.read_text()[:3000]  # ~600 tokens, two windows
    rows = ember_eval.measure("smollm2-135m", ["f32"], ["f16", "q8_0"], window=512,
                              decode_tokens=0, text=text, reference=smollm2_llm.engine.loaded)
    f16, q8 = rows
    assert q8.kv_dtype == "q8_0" and q8.tokens > 500
    assert 0 < q8.kl < 0.002 and q8.top1 > 0.97, (q8.kl, q8.top1)
    assert f16.kl < q8.kl / 20 and f16.top1 >= q8.top1
