"""``ember bench synth``: the GGUF writer, llama.cpp's tensor-type mixture, and
random-weight models that load, run and tokenize like the real ones.

Oracles: the writer is read back by ember's reader and by gguf-py's ``GGUFReader``;
the type policy is checked against expectations worked out here from llama.cpp's
rules (src/llama-quant.cpp) as literal layer sets, against the real Gemma 3 270M
Q4_K_M file that llama-quantize wrote, and (with ``EMBER_LLAMA_BENCH`` naming the
directory of llama.cpp's binaries) against llama-quantize itself on mixtures of
experts; the models against SmolLM2's tokenizer.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from ember.bench import synth
from ember.bench.synth import FILE_TYPES, SHAPES, Shape, synth_tensors, tensor_type, write_synth
from ember.errors import GGUFError
from ember.models.architectures import model_config
from ember.models.gguf import GGMLType, GGUFFile, TensorToWrite, write_gguf
from ember.models.quant import dequantize
from ember.tokenizer import Tokenizer

VT = gguf.GGUFValueType
SMOL_VOCAB = 49152

# Tiny shapes: SmolLM2's vocabulary plus a few hundred placeholders. The llama one is
# 256 wide (no fallbacks); the gemma3 one 288 wide, so its K-quants fall back.
TINY = Shape("tiny", "llama", hidden=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
             ffn=512, vocab=SMOL_VOCAB + 300, tied=True, rope_base=1e4, context=2048,
             norm_eps=1e-5, description="tiny llama")
TINY_FAMILIES = {
    "qwen3-untied": Shape("tiny-qwen3", "qwen3", hidden=256, n_layers=2, n_heads=4,
                          n_kv_heads=2, head_dim=32, ffn=512, vocab=SMOL_VOCAB + 200,
                          tied=False, rope_base=1e6, context=2048, norm_eps=1e-6),
    "gemma3": Shape("tiny-gemma3", "gemma3", hidden=288, n_layers=6, n_heads=4, n_kv_heads=1,
                    head_dim=64, ffn=512, vocab=SMOL_VOCAB + 100, tied=True, rope_base=1e6,
                    context=2048, norm_eps=1e-6, sliding_window=8),
    # as deep as the deepest real shape: the residual stream stays finite
    "qwen3-36-layers": Shape("deep", "qwen3", hidden=256, n_layers=36, n_heads=4,
                             n_kv_heads=2, head_dim=64, ffn=256, vocab=SMOL_VOCAB,
                             tied=True, rope_base=1e6, context=2048, norm_eps=1e-6),
    # mixtures of experts: exactly 8 experts (llama.cpp's rules for Mixtral-like models)
    # and gpt-oss's block (biases, sinks, alternating windows, YaRN)
    "qwen3moe": Shape("tiny-qwen3moe", "qwen3moe", hidden=256, n_layers=8, n_heads=4,
                      n_kv_heads=2, head_dim=64, ffn=512, vocab=SMOL_VOCAB, tied=False,
                      rope_base=1e6, context=2048, norm_eps=1e-6, n_experts=8,
                      n_experts_used=2, expert_ffn=256),
    "gpt-oss": Shape("tiny-gpt-oss", "gpt-oss", hidden=256, n_layers=4, n_heads=4,
                     n_kv_heads=2, head_dim=64, ffn=256, vocab=SMOL_VOCAB, tied=False,
                     rope_base=150000.0, context=4096, norm_eps=1e-5, sliding_window=128,
                     n_experts=4, n_experts_used=2, expert_ffn=256, yarn=(32.0, 4096)),
    # Qwen 3.5's hybrids: three Gated DeltaNet layers to one of gated attention (the MoE
    # one with a shared expert)
    "qwen35": Shape("tiny-qwen35", "qwen35", hidden=256, n_layers=8, n_heads=4, n_kv_heads=2,
                    head_dim=64, ffn=512, vocab=SMOL_VOCAB, tied=True, rope_base=1e7,
                    context=2048, norm_eps=1e-6, delta_net=(4, 2, 32, 4, 32),
                    full_attention_interval=4, rope_dim=16),
    "qwen35moe": Shape("tiny-qwen35moe", "qwen35moe", hidden=256, n_layers=4, n_heads=4,
                       n_kv_heads=2, head_dim=64, ffn=256, vocab=SMOL_VOCAB, tied=False,
                       rope_base=1e7, context=2048, norm_eps=1e-6, n_experts=4,
                       n_experts_used=2, expert_ffn=256, delta_net=(4, 2, 32, 4, 32),
                       full_attention_interval=4, rope_dim=16, shared_expert_ffn=256),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, smollm2_file: GGUFFile
                ) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("synth")
    return {q: _write(out / f"tiny-{q}.gguf", TINY, q, smollm2_file) for q in FILE_TYPES}


def _write(path: Path, shape: Shape, quant: str, tok: GGUFFile) -> Path:
    write_synth(path, shape, quant, tok)
    return path


# ------------------------------------------------------------------ the writer

METADATA = {
    "general.architecture": "llama",
    "v.str": "héllo ✓ 世界",
    "v.u32": 4_000_000_000,
    "v.i32": -7,
    "v.i32_typed": np.int32(12),
    "v.f32": 0.5,
    "v.bool": True,
    "v.u64": 1 << 40,
    "v.u64_typed": np.uint64(3),
    "v.u8": np.uint8(200),
    "v.f64": np.float64(0.1),
    "a.str": ["x", "", "ünï", "a b"],
    "a.i32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
    "a.f32": np.array([0.5, -1.25, 1e30], np.float32),
    "a.u32": np.array([0, 2**32 - 1], np.uint32),
    "a.empty_str": [],
}
EXPECTED_TYPES = {
    "general.architecture": [VT.STRING], "v.str": [VT.STRING], "v.u32": [VT.UINT32],
    "v.i32": [VT.INT32], "v.i32_typed": [VT.INT32], "v.f32": [VT.FLOAT32],
    "v.bool": [VT.BOOL], "v.u64": [VT.UINT64], "v.u64_typed": [VT.UINT64],
    "v.u8": [VT.UINT8], "v.f64": [VT.FLOAT64], "a.str": [VT.ARRAY, VT.STRING],
    "a.i32": [VT.ARRAY, VT.INT32], "a.f32": [VT.ARRAY, VT.FLOAT32],
    "a.u32": [VT.ARRAY, VT.UINT32],
    "a.empty_str": [VT.ARRAY],  # gguf-py records no item type for an empty array
}


def _tensors(rng: np.random.Generator) -> dict[str, tuple[tuple[int, ...], GGMLType, bytes]]:
    """Odd sizes (a 7-float vector: 28 bytes) so every tensor after one is padded."""
    def raw(shape: tuple[int, ...], t: GGMLType) -> bytes:
        return rng.bytes(TensorToWrite("x", shape, t, list).nbytes)
    return {
        "norm": ((7,), GGMLType.F32, rng.standard_normal(7).astype(np.float32).tobytes()),
        "f16": ((3, 5), GGMLType.F16, raw((3, 5), GGMLType.F16)),
        "q8": ((3, 64), GGMLType.Q8_0, raw((3, 64), GGMLType.Q8_0)),
        "q4k": ((2, 256), GGMLType.Q4_K, raw((2, 256), GGMLType.Q4_K)),
        "q6k.3d": ((2, 1, 256), GGMLType.Q6_K, raw((2, 1, 256), GGMLType.Q6_K)),
    }


def _chunked(data: bytes):  # noqa: ANN202
    """Bytes and uint8 arrays of uneven sizes, as a generator would give them."""
    def chunks():  # noqa: ANN202
        cut = len(data) // 3
        yield data[:cut]
        yield np.frombuffer(data[cut:], dtype=np.uint8)
    return chunks


@pytest.mark.parametrize("alignment", [None, 64])
def test_writer_round_trips_through_ember_and_gguf_py(tmp_path: Path,
                                                      alignment: int | None) -> None:
    tensors = _tensors(np.random.default_rng(0))
    metadata = dict(METADATA)
    if alignment:
        metadata["general.alignment"] = alignment
    path = tmp_path / "w.gguf"
    with open(path, "wb") as f:
        n = write_gguf(f, metadata, [TensorToWrite(name, shape, t, _chunked(data))
                                     for name, (shape, t, data) in tensors.items()])
    assert n == path.stat().st_size

    ours = GGUFFile(path)
    assert ours.version == 3
    assert list(ours.metadata) == list(metadata)
    for key, value in metadata.items():
        got = ours.metadata[key]
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.tolist() == value.tolist(), key
        else:
            assert got == (value if not isinstance(value, float) else pytest.approx(value)), key
    assert list(ours.tensors) == list(tensors)
    step = alignment or 32
    for name, (shape, t, data) in tensors.items():
        info = ours.tensors[name]
        assert (info.shape, info.ggml_type) == (shape, t), name
        assert (info.offset - ours.data_offset) % step == 0, name
        assert ours.tensor_bytes(name).tobytes() == data, name

    ref = gguf.GGUFReader(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(metadata)
    for key, value in metadata.items():
        assert fields[key].types == EXPECTED_TYPES.get(key, [VT.UINT32]), key
        expected = value.tolist() if isinstance(value, np.ndarray) else value
        got = fields[key].contents()
        assert got == (pytest.approx(expected) if isinstance(expected, float) else expected), key
    assert [t.name for t in ref.tensors] == list(tensors)
    for t in ref.tensors:
        shape, ggml_type, data = tensors[t.name]
        assert tuple(int(d) for d in reversed(t.shape)) == shape, t.name
        assert int(t.tensor_type) == ggml_type, t.name
        assert int(t.data_offset) == ours.tensors[t.name].offset, t.name
        assert np.asarray(t.data).reshape(-1).view(np.uint8).tobytes() == data, t.name


@pytest.mark.parametrize("extra", [1, -1])
def test_writer_refuses_chunks_that_do_not_fill_the_tensor(tmp_path: Path, extra: int) -> None:
    data = bytes(34 * 2 + extra)  # two Q8_0 blocks, one byte more or less
    t = TensorToWrite("q8", (1, 64), GGMLType.Q8_0, lambda: [data])
    with open(tmp_path / "bad.gguf", "wb") as f, pytest.raises(GGUFError, match="'q8'.*68"):
        write_gguf(f, {"general.architecture": "llama"}, [t])


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, np.zeros((2, 2), np.float32), 1 << 70])
def test_writer_names_a_value_it_cannot_type(tmp_path: Path, value: object) -> None:
    with open(tmp_path / "bad.gguf", "wb") as f, pytest.raises(GGUFError, match="'k'"):
        write_gguf(f, {"k": value}, [])


# ------------------------------------------------------------------ the type policy
# use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2, worked out by hand:
MORE_BITS = {
    6: {2, 5},
    8: {0, 3, 6, 7},
    16: {0, 1, 4, 7, 10, 13, 14, 15},
    26: {0, 1, 2, 5, 8, 11, 14, 17, 20, 22, 23, 24, 25},
    28: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27},
    32: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31},
    36: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35},
    48: {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45,
         46, 47},
}


def _types(shape: Shape, quant: str) -> dict[str, str]:
    return {name: tensor_type(name, dims, quant, n_layers=shape.n_layers,
                              tied=shape.tied, n_experts=shape.n_experts).name
            for name, dims in synth_tensors(shape)}


def _layers(types: dict[str, str], suffix: str, t: str) -> set[int]:
    return {int(n.split(".")[1]) for n, v in types.items() if n.endswith(suffix) and v == t}


@pytest.mark.parametrize("name", ["llama-1b", "llama-3b", "llama-8b", "qwen3-4b"])
@pytest.mark.parametrize("quant, base", [("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K")])
def test_k_m_mixtures_give_attn_v_and_ffn_down_six_bits_where_llama_cpp_does(
        name: str, quant: str, base: str) -> None:
    shape = SHAPES[name]
    types = _types(shape, quant)
    more = MORE_BITS[shape.n_layers]
    for suffix in ("attn_v.weight", "ffn_down.weight"):
        assert _layers(types, suffix, "Q6_K") == more, suffix
        assert _layers(types, suffix, base) == set(range(shape.n_layers)) - more, suffix
    for suffix in ("attn_q.weight", "attn_k.weight", "attn_output.weight", "ffn_gate.weight",
                   "ffn_up.weight"):
        assert _layers(types, suffix, base) == set(range(shape.n_layers)), suffix
    head = "token_embd.weight" if shape.tied else "output.weight"
    assert types[head] == "Q6_K"
    if not shape.tied:
        assert types["token_embd.weight"] == base
    assert {v for n, v in types.items() if n.endswith("norm.weight")} == {"F32"}
    assert ("output.weight" in types) == (not shape.tied)


@pytest.mark.parametrize("layers", [None, 6])
def test_qwen3moe_q4_k_m_gives_expert_downs_six_bits_where_llama_cpp_does(layers) -> None:
    """Qwen3-30B-A3B (128 experts): the experts' [E, out, in] stacks follow the dense
    rules by layer; the router stays F32; with --layers the rules see the cut depth."""
    shape = SHAPES["qwen3moe-30b-a3b"].with_layers(layers)
    types, n = _types(shape, "Q4_K_M"), shape.n_layers
    more = MORE_BITS[n]
    for suffix in ("attn_v.weight", "ffn_down_exps.weight"):
        assert _layers(types, suffix, "Q6_K") == more, suffix
        assert _layers(types, suffix, "Q4_K") == set(range(n)) - more, suffix
    for suffix in ("attn_q.weight", "attn_k.weight", "attn_output.weight",
                   "ffn_gate_exps.weight", "ffn_up_exps.weight"):
        assert _layers(types, suffix, "Q4_K") == set(range(n)), suffix
    assert _layers(types, "ffn_gate_inp.weight", "F32") == set(range(n))
    assert (types["output.weight"], types["token_embd.weight"]) == ("Q6_K", "Q4_K")
    dims = dict(synth_tensors(shape))
    assert dims["blk.0.ffn_down_exps.weight"] == (128, 2048, 768)
    assert dims["blk.0.ffn_gate_exps.weight"] == (128, 768, 2048)


def test_gpt_oss_ships_mxfp4_experts_and_q8_0_elsewhere() -> None:
    types = _types(SHAPES["gpt-oss-20b"], "MXFP4_MOE")
    for name, t in types.items():
        want = ("MXFP4" if name.endswith("_exps.weight") else
                "F32" if name.endswith(("norm.weight", ".bias", "attn_sinks.weight",
                                        "ffn_gate_inp.weight")) else "Q8_0")
        assert t == want, name
    assert dict(synth_tensors(SHAPES["gpt-oss-20b"]))["blk.0.attn_sinks.weight"] == (64,)


@pytest.mark.parametrize("layers", [None, 8])
def test_qwen35_4b_counts_attn_qkv_with_attn_v_as_llama_cpp_does(layers) -> None:
    """Qwen 3.5 4B: a recurrent layer's attn_qkv and an attention layer's attn_v are one
    per layer, and take the attn_v rule by layer; the convolution and the per-head
    parameters stay F32; every 4th layer is attention, its q rows doubled (the gate)."""
    shape = SHAPES["qwen35-4b"].with_layers(layers)
    types, n = _types(shape, "Q4_K_M"), shape.n_layers
    more = MORE_BITS[n]
    attention = {i for i in range(n) if (i + 1) % 4 == 0}
    assert _layers(types, "attn_v.weight", "Q6_K") == more & attention
    assert _layers(types, "attn_qkv.weight", "Q6_K") == more - attention
    assert _layers(types, "attn_qkv.weight", "Q4_K") == set(range(n)) - more - attention
    assert _layers(types, "ffn_down.weight", "Q6_K") == more
    for suffix in ("attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_out.weight"):
        assert _layers(types, suffix, "Q4_K") == set(range(n)) - attention, suffix
    for suffix in ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight"):
        assert _layers(types, suffix, "F32") == set(range(n)) - attention, suffix
    dims = dict(synth_tensors(shape))
    assert dims["blk.3.attn_q.weight"] == (2 * 16 * 256, 2560)
    assert dims["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2560)
    assert dims["blk.0.ssm_conv1d.weight"] == (8192, 4)
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types


def test_exactly_eight_experts_raise_attention_as_llama_cpp_does() -> None:
    types = _types(TINY_FAMILIES["qwen3moe"], "Q4_K_M")
    assert _layers(types, "attn_v.weight", "Q8_0") == set(range(8))
    assert _layers(types, "attn_k.weight", "Q8_0") == set(range(8))
    assert _layers(types, "attn_output.weight", "Q5_K") == set(range(8))


def test_a_cut_shape_is_named_for_its_layers() -> None:
    cut = SHAPES["qwen3moe-30b-a3b"].with_layers(6)
    assert (cut.name, cut.n_layers, cut.n_experts) == ("qwen3moe-30b-a3b-6l", 6, 128)
    assert SHAPES["llama-1b"].with_layers(None) is SHAPES["llama-1b"]
    with pytest.raises(ValueError, match="at least 1"):
        SHAPES["llama-1b"].with_layers(0)
    with pytest.raises(ValueError, match="need experts"):
        Shape("x", "qwen3moe", hidden=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64,
              ffn=256, vocab=SMOL_VOCAB, tied=True, rope_base=1e6, context=64,
              norm_eps=1e-6)


@pytest.mark.skipif(not os.environ.get("EMBER_LLAMA_BENCH"),
                    reason="set EMBER_LLAMA_BENCH to the directory of llama.cpp's binaries "
                           "(llama-quantize) to run this")
@pytest.mark.parametrize("family", ["qwen3moe", "gpt-oss", "qwen35", "qwen35moe"])
def test_moe_policy_reproduces_what_llama_quantize_writes(
        tmp_path: Path, smollm2_file: GGUFFile, family: str) -> None:
    """llama-quantize requantizes a Q8_0 synth file to each file type: every tensor's
    type is the one tensor_type gives."""
    shape = TINY_FAMILIES[family]
    bins = Path(os.environ["EMBER_LLAMA_BENCH"])
    src = _write(tmp_path / "src.gguf", shape, "Q8_0", smollm2_file)
    for quant in ("Q4_K_M", "Q5_K_M", "Q4_0", "MXFP4_MOE"):
        dst = tmp_path / f"{quant}.gguf"
        subprocess.run([str(bins / "llama-quantize"), "--allow-requantize", str(src), str(dst),
                        quant], check=True, capture_output=True,
                       env={**os.environ, "LD_LIBRARY_PATH": str(bins)})
        theirs = {n: i.type_name for n, i in GGUFFile(dst).tensors.items()}
        assert theirs == _types(shape, quant), quant


def test_llama_1b_q4_k_m_histogram() -> None:
    types = {n: GGMLType[t] for n, t in _types(SHAPES["llama-1b"], "Q4_K_M").items()}
    assert synth.type_histogram(types) == "Q4_K: 96, Q6_K: 16+1, F32: 33"


@pytest.mark.parametrize("quant, matrix, head", [
    ("Q4_0", "Q4_0", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q6_K", "Q6_K", "Q6_K"),
    ("Q4_1", "Q4_1", "Q6_K"), ("Q5_0", "Q5_0", "Q6_K")])
def test_plain_file_types_change_only_the_head(quant: str, matrix: str, head: str) -> None:
    types = _types(SHAPES["llama-8b"], quant)  # untied: the embedding keeps the file type
    assert types.pop("output.weight") == head
    assert {v for n, v in types.items() if not n.endswith("norm.weight")} == {matrix}


# gemma3-1b: 1152 = 4.5 x 256 wide inputs (q, k, v, gate, up, the tied embedding);
# attn_output takes 1024, ffn_down 6912 = 27 x 256, both K-quant friendly.
@pytest.mark.parametrize("quant, narrow, wide, more_v, more_down, head", [
    ("Q4_K_M", "Q5_0", "Q4_K", "Q8_0", "Q6_K", "Q8_0"),
    ("Q5_K_M", "Q5_1", "Q5_K", "Q8_0", "Q6_K", "Q8_0"),
    ("Q6_K", "Q8_0", "Q6_K", "Q8_0", "Q6_K", "Q8_0"),
    ("Q4_0", "Q4_0", "Q4_0", "Q4_0", "Q4_0", "Q8_0"),
    ("Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0"),
])
def test_gemma3_1b_rows_of_1152_fall_back_as_llama_cpp_does(
        quant: str, narrow: str, wide: str, more_v: str, more_down: str, head: str) -> None:
    types = _types(SHAPES["gemma3-1b"], quant)
    expected = {"token_embd.weight": head}
    for i in range(26):
        p, more = f"blk.{i}.", i in MORE_BITS[26]
        for m in ("attn_q", "attn_k", "ffn_gate", "ffn_up"):
            expected[p + m + ".weight"] = narrow
        expected[p + "attn_v.weight"] = more_v if more else narrow
        expected[p + "attn_output.weight"] = wide
        expected[p + "ffn_down.weight"] = more_down if more else wide
    assert {n: t for n, t in types.items() if not n.endswith("norm.weight")} == expected


def test_policy_reproduces_a_file_llama_quantize_wrote(gemma3_file: GGUFFile) -> None:
    """Gemma 3 270M Q4_K_M (18 layers, 640 wide: most K-quants fall back)."""
    n_layers = int(gemma3_file.metadata["gemma3.block_count"])
    tied = "output.weight" not in gemma3_file.tensors
    ours = {name: tensor_type(name, info.shape, "Q4_K_M", n_layers=n_layers, tied=tied).name
            for name, info in gemma3_file.tensors.items()}
    theirs = {name: info.type_name for name, info in gemma3_file.tensors.items()}
    assert ours == theirs
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"} <= set(theirs.values())


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="'Q3_K_S'.*Q4_K_M"):
        tensor_type("blk.0.attn_q.weight", (256, 256), "Q3_K_S", n_layers=2, tied=True)
    with pytest.raises(ValueError, match="'llama-70b'.*llama-1b"):
        synth.shape_named("llama-70b")


# ------------------------------------------------------------------ the models


@pytest.mark.parametrize("quant", list(FILE_TYPES))
def test_every_file_type_dequantizes_to_finite_weights_of_the_intended_spread(
        tiny_models: dict[str, Path], quant: str) -> None:
    f = GGUFFile(tiny_models[quant])
    assert f.metadata["general.file_type"] == FILE_TYPES[quant].ftype
    expected = _types(TINY, quant)
    assert {n: i.type_name for n, i in f.tensors.items()} == expected
    for name, info in f.tensors.items():
        w = dequantize(f.tensor_bytes(name), info.ggml_type, info.shape).numpy()
        assert np.isfinite(w).all(), name
        if len(info.shape) == 2:
            ratio = w.std() * math.sqrt(info.shape[-1])
            assert 1 / 3 < ratio < 3, (name, info.type_name, ratio)


def _assert_runs(path: Path) -> None:
    from ember import LLM, SamplingParams
    from ember.models.loader import load_model

    logits = load_model(str(path), "f32").model.score(list(range(5, 200, 7)))
    assert logits.isfinite().all() and logits.std() > 0
    out = LLM(str(path), weights="f32").generate(
        ["Hello, world"], SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0]
    assert len(out.token_ids) == 4
    assert all(math.isfinite(lp.logprob) for lp in out.logprobs)


@pytest.mark.parametrize("quant", list(FILE_TYPES))
def test_every_file_type_loads_and_generates(tiny_models: dict[str, Path], quant: str) -> None:
    _assert_runs(tiny_models[quant])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_families_load_and_generate(tmp_path: Path, smollm2_file: GGUFFile,
                                    family: str) -> None:
    shape = TINY_FAMILIES[family]
    path = _write(tmp_path / f"{family}.gguf", shape, "Q4_K_M", smollm2_file)
    cfg = model_config(GGUFFile(path))
    assert (cfg.architecture, cfg.n_layers, cfg.vocab_size, cfg.tied_embeddings) == (
        shape.arch, shape.n_layers, shape.vocab, shape.tied)
    assert cfg.qk_norm == (shape.arch != "gpt-oss")
    if shape.arch == "gemma3":
        assert [a.window for a in cfg.layers] == [8] * 5 + [None]
    if shape.n_experts:
        assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_size) == (
            shape.n_experts, shape.n_experts_used, shape.expert_ffn)
    if shape.arch == "gpt-oss":
        assert [a.window for a in cfg.layers] == [128, None] * 2
        assert cfg.attn_sinks and cfg.expert_biases and cfg.rope_yarn is not None
    if shape.arch.startswith("qwen35"):
        from ember.models.inspect import format_report, inspect_gguf

        assert cfg.recurrent_layers == tuple((i + 1) % 4 != 0 for i in range(shape.n_layers))
        assert cfg.attn_output_gate and cfg.rope_dim == 16
        assert cfg.delta_net is not None and cfg.delta_net.conv == 4
        assert cfg.shared_expert_ffn_size == shape.shared_expert_ffn
        # per recurrent layer: 3 conv inputs of 2*2*32 + 4*32 channels, 4 heads of 32x32
        per_layer = 4 * (3 * 256 + 4 * 32 * 32)
        assert cfg.state_bytes_per_sequence == per_layer * sum(cfg.recurrent_layers)
        text = format_report(inspect_gguf(GGUFFile(path)))
        assert "fused native stack: yes" in text and "recurrent layers too" in text
        assert f"recurrent state per sequence: {cfg.state_bytes_per_sequence / 2**20:.2f}" in text
    _assert_runs(path)


def test_tokenizer_is_smollm2s_padded_to_the_vocabulary(tiny_models: dict[str, Path],
                                                        smollm2_file: GGUFFile) -> None:
    f = GGUFFile(tiny_models["Q8_0"])
    ours, theirs = Tokenizer.from_gguf(f), Tokenizer.from_gguf(smollm2_file)
    assert ours.encode("Hello, world") == theirs.encode("Hello, world") == [19556, 28, 905]
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == TINY.vocab == f.tensors["token_embd.weight"].shape[0]
    assert tokens[SMOL_VOCAB:SMOL_VOCAB + 2] == ["<|reserved_0|>", "<|reserved_1|>"]
    types = f.metadata["tokenizer.ggml.token_type"]
    assert (types[SMOL_VOCAB:] == synth.UNUSED_TOKEN).all()
    assert (types[:SMOL_VOCAB] == smollm2_file.metadata["tokenizer.ggml.token_type"]).all()
    for key in ("tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        assert f.metadata[key] == smollm2_file.metadata[key], key


def test_a_tokenizer_larger_than_the_shape_is_refused(smollm2_file: GGUFFile) -> None:
    with pytest.raises(ValueError, match="49152 tokens.*1000"):
        synth.tokenizer_metadata(smollm2_file, 1000)


# ------------------------------------------------------------------ the command


def test_cli_writes_skips_and_forces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str],
                                     smollm2_gguf: Path) -> None:
    from ember.cli import main

    monkeypatch.setitem(SHAPES, "tiny", TINY)
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    monkeypatch.setattr("ember.models.registry.ensure_model", lambda name: smollm2_gguf)
    assert main(["bench", "synth", "--shape", "tiny", "--quant", "Q8_0,Q4_K_M"]) == 0
    out = capsys.readouterr().out
    paths = [tmp_path / "synth" / f"tiny-{q}.gguf" for q in ("Q8_0", "Q4_K_M")]
    assert all(p.is_file() for p in paths)
    assert "Q4_K: 12, Q6_K: 2+1, F32: 5" in out
    mtime = paths[0].stat().st_mtime_ns
    assert main(["bench", "synth", "--shape", "tiny", "--quant", "Q8_0"]) == 0
    assert "kept" in capsys.readouterr().out and paths[0].stat().st_mtime_ns == mtime
    assert main(["bench", "synth", "--shape", "tiny", "--quant", "Q8_0", "--seed", "1",
                 "--force"]) == 0
    assert paths[0].stat().st_mtime_ns != mtime

    assert main(["models"]) == 0
    assert str(paths[0]) in capsys.readouterr().out

    assert main(["bench", "synth", "--shape", "llama-70b"]) == 1
    assert "unknown shape 'llama-70b'" in capsys.readouterr().err


def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       smollm2_file: GGUFFile) -> None:
    calls, real = [], synth._random_chunks

    def failing(*args):  # noqa: ANN002, ANN202
        calls.append(1)
        if len(calls) == 3:  # killed while writing the third tensor
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(synth, "_random_chunks", failing)
    with pytest.raises(KeyboardInterrupt):
        write_synth(tmp_path / "m.gguf", TINY, "Q8_0", smollm2_file)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("quant", list(FILE_TYPES))
def test_a_layer_at_llama_1b_width_runs_packed_as_it_does_in_float(
        tmp_path: Path, smollm2_file: GGUFFile, quant: str) -> None:
    """Llama 3.2 1B's widths (2048 hidden, 32 heads / 8 KV heads of 64, 8192 FFN), one
    layer and SmolLM2's vocabulary: every matrix is packed at its file type (no dense
    fallback) and the packed kernels give the f32 oracle's logits up to int8 activation
    rounding."""
    from dataclasses import replace

    import torch

    from ember.models.loader import load_model

    shape = replace(SHAPES["llama-1b"], n_layers=1, vocab=SMOL_VOCAB)
    path = _write(tmp_path / f"{quant}.gguf", shape, quant, smollm2_file)
    tokens = list(range(5, 600, 13))
    f32 = load_model(str(path), "f32").model.score(tokens)
    packed = load_model(str(path), "q4").model
    assert packed.batch_invariant  # every projection and the head in a packed layout
    q4 = packed.score(tokens)
    assert float((q4 - f32).norm() / f32.norm()) < 0.05
    agree = (q4.argmax(-1) == f32.argmax(-1)).float().mean()
    assert agree > 0.9, float(agree)
    assert torch.isfinite(q4).all()


def test_mxfp4_experts_dequantize_to_the_intended_spread(tmp_path: Path,
                                                         smollm2_file: GGUFFile) -> None:
    """MXFP4's scale is a power of two (E8M0): the spread lands within a factor of √2."""
    path = _write(tmp_path / "oss.gguf", TINY_FAMILIES["gpt-oss"], "MXFP4_MOE", smollm2_file)
    f = GGUFFile(path)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"):
        info = f.tensor(name)
        assert info.type_name == "MXFP4"
        w = dequantize(f.tensor_bytes(name), info.ggml_type, info.shape).numpy()
        ratio = w.std() * math.sqrt(info.shape[-1])
        assert 0.7 < ratio < 1.42, (name, ratio)
