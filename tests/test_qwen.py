"""Qwen 2 and Qwen 3 against transformers, on random-weight GGUFs written here.

transformers loads the same file with its own GGUF reader and Qwen2/Qwen3 code, so
nothing on its side was written here. Both run float32 on the same dequantized Q8_0
weights: observed max |Δlogit| 2.4e-6 (qwen2) and 3.1e-6 (qwen3) with |logits| up
to ~5. ``ATOL`` leaves 30x headroom and is four orders below what dropping the
biases, the q/k norms or NEOX RoPE does (checked by breaking each).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_model import TINY_QWEN

from ember.models.loader import load_model
from ember.sampling.params import SamplingParams

ATOL = 1e-4
IDS = list(range(5, 400, 7))  # 57 tokens of SmolLM2's vocabulary

families = pytest.mark.parametrize("arch", sorted(TINY_QWEN))


def transformers_model(path: Path, arch: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    # transformers' GGUF reader does not map key_length: say the head size (Qwen3)
    extra = {"head_dim": TINY_QWEN[arch]["head_dim"]} if "head_dim" in TINY_QWEN[arch] else {}
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra)


@pytest.fixture(scope="module")
def loaded(tiny_qwen_ggufs):
    return {arch: load_model(str(path), "f32") for arch, path in tiny_qwen_ggufs.items()}


@pytest.fixture(scope="module")
def hf(tiny_qwen_ggufs):
    return {arch: transformers_model(path, arch) for arch, path in tiny_qwen_ggufs.items()}


@families
def test_config_says_how_the_family_differs(loaded, arch: str) -> None:
    cfg = loaded[arch].config
    assert cfg.rope_neox and not cfg.post_norms and cfg.activation == "silu"
    assert (cfg.qkv_bias, cfg.qk_norm) == ((True, False) if arch == "qwen2" else (False, True))
    assert loaded[arch].model.native is None  # the fused stack is llama-only


@families
def test_logits_match_transformers(loaded, hf, arch: str) -> None:
    ours = loaded[arch].model.score(IDS)
    with torch.no_grad():
        theirs = hf[arch](torch.tensor([IDS])).logits[0]
    err = (ours - theirs).abs().max().item()
    print(f"{arch}: max |Δlogit| {err:.1e} (|logits| up to {theirs.abs().max():.1f})")
    assert err < ATOL


@families
def test_greedy_continuation_matches_transformers(loaded, hf, tiny_qwen_ggufs, arch: str
                                                  ) -> None:
    import ember

    n = 24
    with torch.no_grad():
        out = hf[arch].generate(torch.tensor([IDS[:20]]), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n)
    theirs = out[0, 20:].tolist()
    llm = ember.LLM(str(tiny_qwen_ggufs[arch]), weights="f32", num_kv_blocks=64)
    (ours,) = llm.generate([IDS[:20]], SamplingParams(temperature=0, max_tokens=n,
                                                       ignore_eos=True))
    assert list(ours.token_ids) == theirs


@families
def test_q4_format_stays_close_to_f32(loaded, tiny_qwen_ggufs, arch: str) -> None:
    """q4 packs the Q8_0 matrices (int8 activations), op by op for this family."""
    from ember import kernels

    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    q4 = load_model(str(tiny_qwen_ggufs[arch]), "q4")
    ref, got = loaded[arch].model.score(IDS), q4.model.score(IDS)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree > 0.9, agree
    assert (ref - got).abs().max().item() < 0.1
