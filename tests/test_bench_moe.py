"""``ember bench moe``'s parts: the memory cgroup that makes "bigger than RAM" real, and
the MoE it trains for routing that text drives (its written file against the PyTorch
network it was trained as: an independent implementation of the same layers).
Nothing here asserts a speed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.bench.cgroup import CgroupError, MemoryCgroup


def _cgroup(limit: int) -> MemoryCgroup:
    try:
        return MemoryCgroup(limit)
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")


def test_a_memory_cgroup_charges_what_its_process_touches_and_kills_beyond_it(
        tmp_path: Path) -> None:
    """A child that writes 64 MB stays under a 256 MB limit and the cgroup saw it; one
    that writes 512 MB is killed; file pages it reads are charged too (the page cache
    counts, so an mmap-ing engine cannot hide its weights there)."""
    big = tmp_path / "file.bin"
    big.write_bytes(b"x" * (96 << 20))
    touch = ("import sys; b = bytearray(int(sys.argv[1]) << 20); "
             "open(sys.argv[2], 'rb').read() if len(sys.argv) > 2 else None")
    with _cgroup(256 << 20) as cg:
        subprocess.run([sys.executable, "-c", touch, "64"], check=True, preexec_fn=cg.join)
        if cg.peak() is None:
            pytest.skip("this kernel's cgroup keeps no peak (cgroup v2 before Linux 5.19)")
        assert (64 << 20) <= cg.peak() <= (256 << 20)
    with _cgroup(256 << 20) as cg:
        subprocess.run([sys.executable, "-c", touch, "8", str(big)], check=True,
                       preexec_fn=cg.join)
        assert cg.peak() >= (96 << 20)  # the file's pages, read through the page cache
    with _cgroup(256 << 20) as cg:
        done = subprocess.run([sys.executable, "-c", touch, "512"], preexec_fn=cg.join,
                              capture_output=True)
        assert done.returncode != 0 and cg.oom_kills() >= 1
    assert not cg.path.exists()  # removed once its processes are gone


def test_a_memory_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        MemoryCgroup(0)


def test_the_trained_moe_file_computes_what_it_was_trained_as(tmp_path: Path,
                                                               smollm2_file) -> None:
    """A few training steps, written unquantized: ember's f32 logits of the file are the
    training network's (RoPE layout, routing, tied head, every tensor's place)."""
    from ember.bench.moe_train import MoEShape, train, write_gguf
    from ember.models.loader import load_model
    from ember.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_file)
    ids = tokenizer.encode("def parse(line):\n    return line.split(',')\n" * 40)
    shape = MoEShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2,
                     expert_ffn=64)
    model = train(ids, len(smollm2_file.metadata["tokenizer.ggml.tokens"]), shape, steps=3,
                  batch=2, seq=32, log_every=0)
    path = write_gguf(model, smollm2_file, tmp_path / "moe.gguf", quantize=False)
    x = ids[:64]
    with torch.no_grad():
        want = model(torch.tensor([x]))[0][0]
    loaded = load_model(str(path), "f32")
    assert (loaded.config.n_experts, loaded.config.n_experts_used) == (4, 2)
    assert (loaded.model.score(x) - want).abs().max().item() < 1e-4
