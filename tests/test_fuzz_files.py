"""Model files as untrusted input: structure-aware mutations of the seed files
(tests/fuzz_targets.py) through each reader. Every input loads or is refused with a
named error; another exception or a hang fails. A bounded run here; ``scripts/fuzz.py``
runs the same targets under atheris for as long as it is given."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from fuzz_targets import outcome, scratch_targets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

INTERESTING = (0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000,
               0xFFFFFFFF, 0x100000000, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
# (target, examples): the model load is ~60 ms an input, the others under 10 ms
RUNS = {"gguf_model": 120, "lora_gguf": 200, "lora_peft": 200, "kv_block": 300,
        "chat_template": 200}


@pytest.fixture(scope="module")
def targets():
    return scratch_targets()


@st.composite
def mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    """The seed with a few edits where headers live: a little-endian integer overwritten
    with a boundary value, bytes changed, inserted or cut, or the file truncated."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        head = min(len(data), 8192)  # counts, lengths, types, offsets: the first 8 KiB
        at = draw(st.integers(0, max(0, (head if draw(st.booleans()) else len(data)) - 1)))
        kind = draw(st.sampled_from(("u64", "u32", "byte", "insert", "cut", "truncate")))
        if kind in ("u64", "u32"):
            fmt = "<Q" if kind == "u64" else "<I"
            value = draw(st.sampled_from(INTERESTING)) % (1 << (64 if kind == "u64" else 32))
            packed = struct.pack(fmt, value)
            data[at:at + len(packed)] = packed
        elif kind == "byte":
            data[at:at + 1] = bytes([draw(st.integers(0, 255))])
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "cut":
            del data[at:at + draw(st.integers(1, 64))]
        else:
            del data[at:]
    return bytes(data)


@pytest.mark.parametrize("name", list(RUNS))
def test_a_mutated_file_loads_or_is_refused_by_name(targets, name):
    seed = targets.seeds()[name][0]
    target = targets.all()[name]
    assert outcome(target, seed) == "ok"  # the seed itself loads

    @settings(max_examples=RUNS[name], deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutated(seed))
    def run(data: bytes) -> None:
        outcome(target, data)  # raises the finding: any other exception, or a hang

    run()


# ---------------------------------------------------------------- findings, fixed
def test_merges_of_tokens_not_in_the_vocabulary_are_a_tokenizer_error(targets, tmp_path):
    """Found by atheris (gguf_model): a merge whose result is not a token made the
    tokenizers library raise its own bare Exception through the loader."""
    from hf_gguf import rewrite_gguf

    from ember.errors import TokenizerError
    from ember.models.loader import load_model

    bad = rewrite_gguf(targets.model, tmp_path / "bad-merges.gguf",
                       add_keys={"tokenizer.ggml.merges": ["e r", "q z"]})
    with pytest.raises(TokenizerError, match="merges"):
        load_model(str(bad), "f32")


def test_a_tensor_side_beyond_any_real_one_is_refused_at_open(targets):
    """Found by atheris (lora_gguf): a tensor of shape [2^40, 0] has zero bytes, so its
    size passed the file-length check, and then overflowed numpy's reshape (ValueError
    "array is too big") when read."""
    from ember.errors import GGUFError
    from ember.models.gguf import GGUFFile

    seed = bytearray(targets.seeds()["lora_gguf"][0])
    name = b"blk.0.attn_q.weight.lora_a"
    at = seed.index(name) + len(name)  # then n_dims (u32) and ne[0], ne[1] (u64)
    seed[at + 4:at + 20] = struct.pack("<QQ", 0, 1 << 40)
    path = targets._file("huge-side.gguf", bytes(seed))
    with pytest.raises(GGUFError, match="dimension above"):
        GGUFFile(path)


def _patch_dims(data: bytes, tensor: bytes, dims: tuple[int, ...]) -> bytes:
    """The file with ``tensor``'s directory entry given ``dims`` (GGUF order)."""
    out = bytearray(data)
    at = out.index(tensor + struct.pack("<I", len(dims))) + len(tensor) + 4
    out[at:at + 8 * len(dims)] = struct.pack(f"<{len(dims)}Q", *dims)
    return bytes(out)


def test_fused_projections_of_different_input_sizes_are_refused_by_name(targets):
    """Found by atheris (gguf_model): ffn_up given 96 inputs where ffn_gate has 32 made
    torch.cat raise its RuntimeError through the loader."""
    from ember.errors import GGUFError
    from ember.models.loader import load_model

    # (64 inputs, 32 outputs: the same bytes as its 32 x 64, so the file's size checks pass)
    data = _patch_dims(targets.model.read_bytes(), b"blk.0.ffn_up.weight", (64, 32))
    with pytest.raises(GGUFError, match="different input sizes"):
        load_model(str(targets._file("mismatch.gguf", data)), "f32")


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "F16"])
def test_a_tensor_with_no_elements_decodes_to_nothing(ggml_type):
    """Found by atheris (lora_gguf): a Q5_1 lora_a of shape (0, 32) made the
    dequantizer's reshape raise ValueError; now it is an empty tensor (and an adapter
    of rank 0 is refused by name), and bytes claimed by such a tensor are an error."""
    from ember.errors import GGUFError
    from ember.models.gguf import GGMLType
    from ember.models.quant import dequantize

    t = GGMLType[ggml_type]
    width = 256
    assert dequantize(np.zeros(0, np.uint8), t, (0, width)).shape == (0, width)
    with pytest.raises(GGUFError, match="holds nothing"):
        dequantize(np.zeros(64, np.uint8), t, (0, width))


def test_a_rank_0_adapter_is_refused_by_name(targets):
    from ember.models.lora import LoRAError, load_lora

    data = _patch_dims(targets.seeds()["lora_gguf"][0], b"blk.0.attn_q.weight.lora_a",
                       (32, 0))
    with pytest.raises(LoRAError, match="rank of at least 1"):
        load_lora(targets._file("empty.gguf", data), "fuzz", targets.cfg)


def test_a_template_nested_past_the_parsers_recursion_is_refused_by_name():
    """Found by atheris (chat_template): 5,000 nested braces overflowed Jinja's
    recursive-descent parser (RecursionError)."""
    from ember.chat_template import ChatTemplate
    from ember.errors import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="nests too deeply"):
        ChatTemplate("{{" * 5000, bos_token="", eos_token="")
