"""Tiny random transformers checkpoints of each family, turned into GGUFs by llama.cpp.

Nothing on either side of a family test is ember's: transformers builds the model
from its own config class and random weights, llama.cpp's ``convert_hf_to_gguf.py``
writes the GGUF (tensor names, fused projections, Q/K permutations, norm offsets,
metadata keys exactly as users' files have them), and the transformers model is the
logits oracle. Weights are drawn wider than transformers' init (std 0.02 would leave
every logit near zero and greedy at ties) and every norm weight is perturbed, so a
norm read at the wrong place or offset shows.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hf_gguf import rewrite_gguf
from llamacpp_source import Converter

from ember import filelock

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512}


@dataclass(frozen=True)
class Family:
    config_class: str  # transformers' class name
    options: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "gpt2"  # "gpt2": SmolLM2's BPE; "spm": a small SentencePiece model
    n_layers: int = 2
    moe: bool = False  # routed experts: a second file with them in MXFP4
    convert_args: tuple[str, ...] = ()  # more arguments to llama.cpp's converter
    native_stack: bool = True  # the fused native stack runs it
    # the model_type written to config.json, where transformers would otherwise force the
    # family's own tokenizer class on the converter (whose pre-tokenizer over SmolLM2's
    # vocabulary llama.cpp cannot recognise); the checkpoint's weights and keys unchanged
    tokenizer_model_type: str | None = None
    atol: float = 1e-4  # max |Δlogit| against transformers and llama.cpp


FAMILIES: dict[str, Family] = {
    # Mixtral: the llama block, every FFN routed (softmax over the chosen top 2 of 4)
    "mixtral": Family("MixtralConfig", {"head_dim": 16, "num_local_experts": 4,
                                        "num_experts_per_tok": 2}, moe=True),
    # fused qkv and gate|up tensors, NEOX RoPE over 3/4 of each head
    "phi3": Family("Phi3Config", {"partial_rotary_factor": 0.75, "tie_word_embeddings": False}),
    # Phi-3.5 / 4-mini's LongRoPE: per-frequency factors (the short set below the
    # original context), cos/sin scaled by an attention factor
    "phi3-longrope": Family("Phi3Config", {
        "partial_rotary_factor": 0.75, "original_max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0 + 0.5 * i for i in range(6)],
                            "long_factor": [2.0 + i for i in range(6)]}}),
    # alternating sliding-window layers, soft-capped attention scores and logits (caps
    # small enough here to bite), post-norms, GeGLU, sqrt(hidden)-scaled embeddings
    "gemma2": Family("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                      "sliding_window": 6, "attn_logit_softcapping": 4.0,
                                      "final_logit_softcapping": 3.0}, "spm", 4),
    # four scalar multipliers: embeddings, residual branches, attention, logits
    "granite": Family("GraniteConfig", {"embedding_multiplier": 6.0, "residual_multiplier": 0.3,
                                        "attention_multiplier": 0.2, "logits_scaling": 4.0}),
    # no pre-norms, norms after each sublayer, RMSNorm of the whole q and k projections
    "olmo2": Family("Olmo2Config"),
    # every fourth layer without RoPE (NoPE)
    "smollm3": Family("SmolLM3Config", {"no_rope_layer_interval": 4}, n_layers=4),
    # YaRN context extension (any family whose layers share one RoPE): an original
    # context small enough that the ramp between kept and divided frequencies is inside
    # the head
    "smollm3-yarn": Family("SmolLM3Config", {
        "no_rope_layer_interval": 4,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 64}}, n_layers=4),
    # Ministral 3: YaRN with transformers' mscale / mscale_all_dim, and Llama 4's
    # attention temperature, which grows every 16 positions here (a real file: 16k)
    "mistral3": Family("Ministral3Config", {
        "head_dim": 16,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16,
                            "max_position_embeddings": 512, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": 0.5}}),
    # gpt-oss: attention sinks, biases on every projection, alternating sliding windows,
    # YaRN (truncated to whole dims, as the GGUF runs it: llama.cpp has no "truncate"),
    # a router with a bias over experts with biases and OpenAI's clamped SwiGLU
    "gpt-oss": Family("GptOssConfig", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 6,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": True,
                            "original_max_position_embeddings": 64, "rope_theta": 10000.0}},
        moe=True),
    # Qwen 3.5: three Gated DeltaNet (linear attention) layers to one of gated full
    # attention; more value heads than key heads (llama.cpp reorders them), partial
    # interleaved MRoPE (one position for text: plain NEOX over the rotated dims)
    "qwen35": Family("Qwen3_5TextConfig", {
        "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True}},
        # --no-mtp: no MTP head. atol: the f32 delta-rule scan sums in another order than
        # transformers' chunked one; 1.2e-4 measured on an Intel AVX-512/AMX machine
        n_layers=4, convert_args=("--no-mtp",), atol=2e-4),
    # Qwen 3.5 MoE: the same hybrid, every MLP routed (softmax, top 2 of 4, renormalised)
    # plus a shared expert gated by sigmoid(gate · h)
    "qwen35moe": Family("Qwen3_5MoeTextConfig", {
        "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True}},
        n_layers=4, moe=True, convert_args=("--no-mtp",), tokenizer_model_type="qwen3_5_text",
        # routing and recurrence amplify f32 rounding here: ember is 3.1e-4 from
        # transformers; llama.cpp 2.0e-3, at a router near-tie (position 49)
        atol=5e-4),
}


def _gpt2_tokenizer(tokenizer_source: Path, out: Path) -> int:
    """SmolLM2's BPE tokenizer, rebuilt by transformers from the GGUF: llama.cpp's
    converter recognises its pre-tokenizer by the ids it gives a fixed text."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_source.parent),
                                                     gguf_file=tokenizer_source.name)
    tok.save_pretrained(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # what Phi-4-style checkpoints say
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return len(tok)


def _spm_tokenizer(out: Path) -> int:
    """A SentencePiece model trained here on ember's evaluation text (Gemma-style
    families read ``tokenizer.model``)."""
    import sentencepiece as spm

    text = Path(__file__).resolve().parents[1] / "ember" / "data" / "eval_text.txt"
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=512,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        bos_id=2, eos_id=1, unk_id=3, pad_id=0, minloglevel=2)
    return 512


def random_checkpoint(name: str, out: Path, tokenizer: Path, seed: int = 0) -> torch.nn.Module:
    """Write family ``name`` as a transformers checkpoint in ``out``, with the files of
    ``tokenizer`` (a directory from :func:`tokenizer_files`); returns the model."""
    import transformers

    family = FAMILIES[name]
    shutil.copytree(tokenizer / family.tokenizer, out, dirs_exist_ok=True)
    vocab = int((tokenizer / family.tokenizer / "vocab_size").read_text())
    (out / "vocab_size").unlink()
    config_class: Callable[..., Any] = getattr(transformers, family.config_class)
    config = config_class(vocab_size=vocab, num_hidden_layers=family.n_layers,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          **{**SHAPE, **family.options})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager").eval()  # eager: soft caps
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights (gemma's are offsets from 1: either way, moved)
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    if family.tokenizer_model_type:
        saved = json.loads((out / "config.json").read_text())
        saved["model_type"] = family.tokenizer_model_type
        (out / "config.json").write_text(json.dumps(saved))
    return model


def tokenizer_files(out: Path, tokenizer_source: Path) -> Path:
    """Both tokenizers' files, built once: ``out/gpt2`` and ``out/spm``."""
    for kind, build in (("gpt2", lambda d: _gpt2_tokenizer(tokenizer_source, d)),
                        ("spm", _spm_tokenizer)):
        (out / kind).mkdir(parents=True, exist_ok=True)
        (out / kind / "vocab_size").write_text(str(build(out / kind)))
    return out


@dataclass
class ConvertedFamily:
    name: str
    hf: torch.nn.Module  # the transformers model: the oracle
    f32: Path  # converted at full precision: compared with ``hf``
    q8_0: Path  # converted to Q8_0: the fused native stack's packed weights
    mxfp4: Path | None = None  # MoE families: the f32 file with its experts in MXFP4


def convert_families(names: list[str], root: Path, tokenizer_source: Path,
                     converter: Callable[[], Converter]) -> dict[str, ConvertedFamily]:
    """Each family as a checkpoint and its two GGUFs: llama.cpp's converter writes the
    f32 file (two at a time, each in a fork of one process that imported it, which does
    so while the checkpoints are made here), gguf-py quantizes its matrices to Q8_0 for
    the native stack (as the converter's ``--outtype q8_0`` does, without a second
    conversion).

    Kept on disk under ``$EMBER_HOME/test-families/<key>`` and reused while the key holds:
    it hashes everything the files depend on — this module and the GGUF rewriter, the
    families' specs, the versions of transformers, torch and llama.cpp's converter source,
    and the tokenizer's source file. On a miss the files are made under ``root`` and
    moved there whole (``converter()`` is then started; a hit never starts it)."""
    cached = _family_cache(names, tokenizer_source)
    if not (cached / "done").exists():
        made = _convert(names, root, tokenizer_source, converter())
        with filelock.exclusive(cached.with_name(cached.name + ".lock")):
            if not (cached / "done").exists():
                staging = cached.with_name(cached.name + ".staging")
                shutil.rmtree(staging, ignore_errors=True)
                shutil.copytree(made, staging)
                (staging / "done").write_text("")
                shutil.rmtree(cached, ignore_errors=True)
                staging.rename(cached)
    return {n: ConvertedFamily(
        n, _load_checkpoint(n, cached / f"{n}-hf"), cached / f"tiny-{n}-f32.gguf",
        cached / f"tiny-{n}-q8_0.gguf",
        cached / f"tiny-{n}-mxfp4.gguf" if FAMILIES[n].moe else None)
        for n in names}


def _family_cache(names: list[str], tokenizer_source: Path) -> Path:
    import hashlib

    import transformers
    from llamacpp_source import SDIST_VERSION, llamacpp_source

    from ember.models.registry import ember_home

    here = Path(__file__).parent
    source = os.environ.get("EMBER_LLAMA_CPP_SOURCE") or SDIST_VERSION
    converter = llamacpp_source() / "convert_hf_to_gguf.py"
    parts = [(here / "hf_families.py").read_bytes(), (here / "hf_gguf.py").read_bytes(),
             repr(sorted(names)).encode(), transformers.__version__.encode(),
             torch.__version__.encode(), source.encode(), converter.read_bytes(),
             f"{tokenizer_source.stat().st_size}:{tokenizer_source.name}".encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    return ember_home() / "test-families" / key


def _load_checkpoint(name: str, path: Path) -> torch.nn.Module:
    """A family's transformers model as it was made: built from its own config class and
    given its saved state dict (``oracle.pt``) — not ``from_pretrained``, whose checkpoint
    conversions follow the model_type config.json names for the converter's sake."""
    import transformers

    config = getattr(transformers, FAMILIES[name].config_class).from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(torch.load(path / "oracle.pt"))
    return model.eval()


def _convert(names: list[str], root: Path, tokenizer_source: Path,
             converter: Converter) -> Path:
    tokenizer = tokenizer_files(root / "tokenizers", tokenizer_source)
    for name in names:
        model = random_checkpoint(name, root / f"{name}-hf", tokenizer)
        torch.save(model.state_dict(), root / f"{name}-hf" / "oracle.pt")
    f32 = dict(zip(names, converter.convert(
        [(root / f"{n}-hf", root / f"tiny-{n}-f32.gguf", FAMILIES[n].convert_args)
         for n in names]), strict=True))
    for n in names:
        rewrite_gguf(f32[n], root / f"tiny-{n}-q8_0.gguf", q8_0=True)
        if FAMILIES[n].moe:
            rewrite_gguf(f32[n], root / f"tiny-{n}-mxfp4.gguf", mxfp4_experts=True)
    return root
