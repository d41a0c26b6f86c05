"""ember.models.quant against gguf-py's independent reference dequantizer.

Comparisons are bit-exact (f32 bit patterns, so signed zeros and NaN payloads count
too): quant.py performs the same f32 operations in the same order as the reference,
so no tolerance is needed.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from ember.errors import GGUFError, UnsupportedModelError
from ember.models.gguf import BLOCK_GEOMETRY, GGMLType, GGUFFile
from ember.models.quant import (
    SUPPORTED_TYPES,
    dequantize,
    q4_0_unpack,
    q4_1_unpack,
    q4_k_unpack,
    q5_0_unpack,
    q5_1_unpack,
    q5_k_unpack,
    q6_k_unpack,
    q8_0_unpack,
)

# Byte offsets of each block format's f16 scale fields; random test blocks get
# finite values written there so the reference and ember both stay out of inf/nan.
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}
QUANTIZABLE = [  # the types gguf.quants.quantize can produce
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.MXFP4,
]


def reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    qtype = gguf.GGMLQuantizationType(int(ggml_type))
    return gguf.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(shape)


def assert_bit_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    ours_np = ours.numpy()
    assert ours_np.shape == ref.shape
    ref = np.ascontiguousarray(ref, dtype=np.float32)
    mismatch = np.flatnonzero(ours_np.view(np.uint32) != ref.view(np.uint32))
    assert mismatch.size == 0, (
        f"{mismatch.size} mismatches, first at flat index {mismatch[0]}: "
        f"{ours_np.reshape(-1)[mismatch[0]]} vs {ref.reshape(-1)[mismatch[0]]}"
    )


def random_blocks(ggml_type: GGMLType, n_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes with finite f16 scales: every code and sub-scale bit is exercised."""
    rng = np.random.default_rng(seed)
    _, block_bytes = BLOCK_GEOMETRY[ggml_type]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for start in F16_FIELDS[ggml_type]:
        scales = rng.uniform(-2.0, 2.0, size=n_blocks).astype(np.float16)
        raw[:, start : start + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw


# ------------------------------------------------------------------- synthetic data


def test_supported_types_are_exactly_the_tested_ones() -> None:
    assert SUPPORTED_TYPES == frozenset(QUANTIZABLE) | frozenset(F16_FIELDS)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_random_floats_match_reference(ggml_type: GGMLType) -> None:
    rng = np.random.default_rng(int(ggml_type))
    shape = (6, 256)
    data = rng.standard_normal(shape).astype(np.float32) * 3
    data[0, :32] = 0.0  # an all-zero block: d == 0
    data[1, :32] = 1.5  # a constant block: max == min
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType(int(ggml_type)))
    raw = np.ascontiguousarray(raw).view(np.uint8)
    assert_bit_equal(dequantize(raw, ggml_type, shape), reference(raw, ggml_type, shape))


@pytest.mark.parametrize("ggml_type", list(F16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_match_reference(ggml_type: GGMLType) -> None:
    block_elems, _ = BLOCK_GEOMETRY[ggml_type]
    rows, blocks_per_row = 5, 3
    raw = random_blocks(ggml_type, rows * blocks_per_row, seed=int(ggml_type))
    shape = (rows, blocks_per_row * block_elems)
    assert_bit_equal(dequantize(raw, ggml_type, shape), reference(raw, ggml_type, shape))


@pytest.mark.parametrize("ggml_type", [GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_random_half_bit_patterns_match_reference(ggml_type: GGMLType) -> None:
    # Includes infinities, NaNs and subnormals: widening must keep them all.
    raw = np.random.default_rng(7).integers(0, 256, size=2 * 4 * 64, dtype=np.uint8)
    assert_bit_equal(dequantize(raw, ggml_type, (4, 64)), reference(raw, ggml_type, (4, 64)))


def test_three_dimensional_shape() -> None:
    raw = random_blocks(GGMLType.Q4_K, 2 * 3, seed=1)
    out = dequantize(raw, GGMLType.Q4_K, (2, 3, 256))
    assert out.shape == (2, 3, 256)
    assert_bit_equal(out.reshape(6, 256), reference(raw, GGMLType.Q4_K, (6, 256)))


def test_torch_input_and_scalar_shape() -> None:
    raw = random_blocks(GGMLType.Q6_K, 2, seed=3)
    out = dequantize(torch.from_numpy(raw.copy()), GGMLType.Q6_K, (2, 256))
    assert_bit_equal(out, reference(raw, GGMLType.Q6_K, (2, 256)))
    one = np.array([2.5], dtype=np.float32).view(np.uint8)
    assert dequantize(one, GGMLType.F32, ()).item() == 2.5


def test_read_only_input_no_warning_and_no_aliasing() -> None:
    raw = random_blocks(GGMLType.Q8_0, 4, seed=5)
    f32 = np.arange(8, dtype=np.float32).view(np.uint8)
    for arr in (raw, f32):
        arr.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dequantize(f32, GGMLType.F32, (8,))
        q, _ = q8_0_unpack(raw, (4, 32))
    out += 1  # results are writable and own their memory
    q += 1
    assert np.array_equal(f32.view(np.float32), np.arange(8, dtype=np.float32))
    assert not np.shares_memory(q.numpy(), raw)


UNPACKERS = {
    GGMLType.Q8_0: (q8_0_unpack, torch.int8, -128, 127),
    GGMLType.Q4_0: (q4_0_unpack, torch.int8, -8, 7),
    GGMLType.Q4_1: (q4_1_unpack, torch.uint8, 0, 15),
    GGMLType.Q5_0: (q5_0_unpack, torch.int8, -16, 15),
    GGMLType.Q5_1: (q5_1_unpack, torch.uint8, 0, 31),
    GGMLType.Q4_K: (q4_k_unpack, torch.uint8, 0, 15),
    GGMLType.Q5_K: (q5_k_unpack, torch.uint8, 0, 31),
    GGMLType.Q6_K: (q6_k_unpack, torch.int8, -32, 31),
}


@pytest.mark.parametrize("ggml_type", list(UNPACKERS), ids=lambda t: t.name)
def test_unpackers_shapes_ranges_and_reconstruction(ggml_type: GGMLType) -> None:
    unpack, dtype, lo, hi = UNPACKERS[ggml_type]
    block_elems, _ = BLOCK_GEOMETRY[ggml_type]
    shape = (3, 2 * block_elems)
    raw = random_blocks(ggml_type, 6, seed=11)
    q, scale, *offset = unpack(raw, shape)
    group = 16 if ggml_type == GGMLType.Q6_K else 32
    assert q.dtype == dtype and q.shape == (3, shape[1] // group, group)
    assert scale.dtype == torch.float32 and scale.shape == q.shape[:2]
    assert int(q.min()) >= lo and int(q.max()) <= hi
    rebuilt = q.float() * scale[..., None]
    if offset:
        sign = -1 if ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K) else 1
        rebuilt = rebuilt + sign * offset[0][..., None]
    assert_bit_equal(rebuilt.reshape(shape), reference(raw, ggml_type, shape))


# ---------------------------------------------------------------------------- errors


def test_unsupported_type_names_it() -> None:
    with pytest.raises(UnsupportedModelError, match=r"IQ2_XXS.*supported: F32, F16"):
        dequantize(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, (256,), name="blk.0.w")
    with pytest.raises(UnsupportedModelError, match="'blk.0.w'"):
        dequantize(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, (256,), name="blk.0.w")
    with pytest.raises(UnsupportedModelError, match="type#99"):
        dequantize(np.zeros(4, np.uint8), 99, (1,))


def test_wrong_byte_count_names_the_numbers() -> None:
    raw = np.zeros(2 * 20 - 1, np.uint8)
    with pytest.raises(GGUFError, match=r"'w'.*Q4_1.*\(2, 32\) needs 40 bytes, got 39"):
        dequantize(raw, GGMLType.Q4_1, (2, 32), name="w")
    with pytest.raises(GGUFError, match="needs 8 bytes, got 6"):
        dequantize(np.zeros(6, np.uint8), GGMLType.F32, (2,))


def test_row_not_whole_blocks() -> None:
    with pytest.raises(GGUFError, match="row length 48 is not a multiple of the Q8_0 block size"):
        dequantize(np.zeros(34 * 3, np.uint8), GGMLType.Q8_0, (2, 48))


# ---------------------------------------------------------------------- real tensors


def first_rows(f: GGUFFile, name: str, n_rows: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """The bytes and shape of a tensor's first ``n_rows`` rows (all of a 1-D tensor)."""
    info = f.tensor(name)
    raw = f.tensor_bytes(name)
    if len(info.shape) == 1:
        return raw, info.shape
    rows = info.n_elements // info.shape[-1]
    n_rows = min(n_rows, rows)
    return raw[: info.nbytes // rows * n_rows], (n_rows, info.shape[-1])


def check_real(f: GGUFFile, name: str, n_rows: int = 64) -> None:
    info = f.tensor(name)
    raw, shape = first_rows(f, name, n_rows)
    ours = dequantize(raw, info.ggml_type, shape, name=name)
    assert_bit_equal(ours, reference(raw, info.ggml_type, shape))


@pytest.mark.parametrize(
    "name",
    [
        "token_embd.weight",
        "blk.0.ffn_down.weight",
        "blk.29.attn_v.weight",
        "blk.0.attn_norm.weight",
    ],
)
def test_smollm2_tensors_match_reference(smollm2_file: GGUFFile, name: str) -> None:
    check_real(smollm2_file, name)


def test_smollm2_whole_tensor_shape(smollm2_file: GGUFFile) -> None:
    info = smollm2_file.tensor("blk.0.ffn_gate.weight")
    out = dequantize(smollm2_file.tensor_bytes(info.name), info.ggml_type, info.shape)
    assert out.shape == info.shape == (1536, 576)
    assert torch.isfinite(out).all()


def test_gemma3_tensors_match_reference(gemma3_file: GGUFFile) -> None:
    # One tensor of each type the file holds (Q4_K_M mixes several), a few rows each.
    first_of_type: dict[int, str] = {}
    for name, info in gemma3_file.tensors.items():
        first_of_type.setdefault(info.ggml_type, name)
    assert {GGMLType.Q4_K, GGMLType.Q6_K} <= set(first_of_type)
    for ggml_type, name in sorted(first_of_type.items()):
        assert ggml_type in SUPPORTED_TYPES, name
        check_real(gemma3_file, name, n_rows=32)


@pytest.mark.parametrize("qtype", [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL,
                                   GGMLType.IQ4_XS, GGMLType.MXFP4], ids=lambda t: t.name)
def test_a_model_of_the_compact_formats_loads_and_generates(qtype, tmp_path, smollm2_file):
    """A random-weight llama whose every matrix is of ``qtype`` loads in both weight
    formats (q4 packs Q3_K, IQ4_NL, IQ4_XS and MXFP4 for the native kernels and the
    fused stack, and keeps Q2_K dense f32: no packed layout for it yet), its fused QKV holds
    gguf-py's dequantization of the three tensors bit for bit, and both formats
    generate the same greedy tokens."""
    from tiny_model import write_tiny_llama

    from ember import LLM
    from ember.models.gguf import GGUFFile
    from ember.models.loader import load_model
    from ember.sampling.params import SamplingParams

    path = write_tiny_llama(tmp_path / f"tiny-{qtype.name}.gguf", smollm2_file, hidden=256,
                            n_heads=4, n_kv_heads=2, ffn=256,
                            qtype=gguf.GGMLQuantizationType(int(qtype)))
    gg = GGUFFile(path)
    want = np.concatenate([
        reference(gg.tensor_bytes(f"blk.1.attn_{x}.weight"), qtype, gg.tensor(
            f"blk.1.attn_{x}.weight").shape) for x in "qkv"])
    f32 = load_model(str(path), "f32")
    got = f32.model.layers[1].qkv.weight.numpy()
    assert got.view(np.uint32).tolist() == want.astype(np.float32).view(np.uint32).tolist()
    q4 = load_model(str(path), "q4")
    packed = (GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4)
    assert (q4.model.native is not None) == (qtype in packed)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {w: LLM(str(path), weights=w, num_kv_blocks=64).generate(["The harbour"], params)[0]
            for w in ("f32", "q4")}
    assert len(outs["f32"].token_ids) == 12
    assert outs["f32"].token_ids == outs["q4"].token_ids


def test_mxfp4_every_exponent_and_code_match_reference() -> None:
    """Random MXFP4 blocks with every E8M0 exponent (the subnormal halves below 2
    included) and every code: bit for bit as gguf-py."""
    rng = np.random.default_rng(39)
    raw = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    shape = (16, 16 * 32)
    with np.errstate(over="ignore"):  # 2^127 x 12 is inf here as in the reference
        assert_bit_equal(dequantize(raw, GGMLType.MXFP4, shape),
                         reference(raw, GGMLType.MXFP4, shape))
