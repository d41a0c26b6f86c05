"""The native quantized-matmul kernels (ember/kernels) and the ``q4`` weight format.

Oracle: the weight dequantized by ember.models.quant (itself bit-exact against
gguf-py, see test_quant.py), then ``F.linear`` in float32.

Two kernel paths, two kinds of check:

* GEMM path (M >= gemm_min_m; off by default, an exact-prefill option): weights are
  dequantized to f32 in chunks and multiplied by BLAS. The dequantized weights are
  bit-identical to the oracle's and the product is the same f32 GEMM, so the result
  must agree to f32 rounding (``rtol=1e-5`` plus a K-scaled absolute slack for
  cancellation).

* Integer path (the default for every M): activations are quantized per 32 to int8
  (d = max|x|/127, round half to even) like llama.cpp's Q8 activations. That is an
  approximation, checked two ways:
  1. exactly: an independent float64 emulation of the same arithmetic (same int8
     codes, exact integer dots, the 4-bit offset taken against the exact float block
     sums) must match to f32 accumulation error (relative 1e-5 of the row scale);
  2. against the f32 oracle: the relative Frobenius error ||y - y_ref|| / ||y_ref||.
     Rounding x to 1/127 of its block max gives per-element error ~ max|x|/127/sqrt(12),
     about 0.5% of x's rms for Gaussian blocks; with centred weight codes the output
     error is the same fraction of the output, so we see 0.2-0.7% and assert < 2%.
  End to end (real text, teacher forced) the int8 path must keep >= 90% top-1
  agreement with f32 and a mean KL(f32 || q4) < 0.02 nats; observed values are printed.

The tests skip (with the build error as the reason) when the extension cannot build.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ember import kernels
from ember.errors import UnsupportedModelError
from ember.models import linear as linear_mod
from ember.models.gguf import GGMLType, GGUFFile
from ember.models.linear import ConcatLinear, DenseLinear, QuantFormat, QuantLinear
from ember.models.quant import (
    dequantize,
    q4_0_unpack,
    q4_1_unpack,
    q5_0_unpack,
    q8_0_unpack,
    unpack_affine,
)

MS = [1, 3, 16, 64, 300]
INT_PATH = 10**9  # gemm_min_m that keeps every M on the integer path (the default)
GEMM_PATH = 0  # gemm_min_m that sends every M to the dequantize + GEMM path
REL_TOL_INT8 = 2e-2


@pytest.fixture(scope="module")
def ext():
    mod = kernels.quant_matmul()
    if mod is None:
        pytest.skip(f"quant_matmul extension unavailable: {kernels.unavailable_reason()}")
    return mod


# ----------------------------------------------------------------------- helpers


def random_raw(qtype: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF bytes of a random [rows, cols] matrix quantized by gguf-py (the reference)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w += rng.standard_normal((rows, cols // 32, 1)).astype(np.float32).repeat(32, -1).reshape(
        rows, cols) * 0.02  # per-block offsets, so Q4_1's m matters
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(qtype))).reshape(-1)


K_TYPES = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


def random_kquant_raw(qtype: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize to K-quants): random code and
    scale bytes, with the f16 super-scales set to sane magnitudes."""
    from ember.models.quant import BLOCK_GEOMETRY

    rng = np.random.default_rng(seed)
    elems, size = BLOCK_GEOMETRY[qtype]
    blk = rng.integers(0, 256, (rows * cols // elems, size), dtype=np.uint8)
    def f16(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, len(blk)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == GGMLType.Q6_K:
        blk[:, 208:210] = f16(1e-4, 2e-3)
    else:
        blk[:, 0:2] = f16(1e-4, 2e-3)  # d
        blk[:, 2:4] = f16(0.0, 2e-3)  # dmin
    return blk.reshape(-1)


def oracle_weight(parts) -> torch.Tensor:
    return torch.cat([dequantize(raw, t, shape) for raw, t, shape in parts])


def emulate_quantize_x(x: torch.Tensor):
    """float32 emulation of the kernel's activation quantization: codes, d, block sums."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127.0
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # round half to even, like cvtps/nearbyint
    return q.to(torch.int8).reshape(x.shape), d, xb.double().sum(-1)


def emulate_int_path(x: torch.Tensor, parts) -> torch.Tensor:
    """Float64 model of the integer path, built from quant.py's unpackers."""
    q, d, s = emulate_quantize_x(x)
    xhat = (q.double().reshape(x.shape[0], -1, 32) * d.double()[..., None]).reshape(x.shape)
    outs = []
    types = {t for _, t, _ in parts}  # the layout QuantLinear.from_raw picks
    k8 = not types <= {GGMLType.Q4_0, GGMLType.Q4_1} and not types <= {GGMLType.Q8_0,
                                                                       GGMLType.Q5_0}
    for raw, t, shape in parts:
        if k8:  # w = q s (per 16 or 32) + offset (per 32), as the k8 kernel sums it
            codes, scale, offset = unpack_affine(raw, t, shape)
            w = (torch.from_numpy(codes.astype(np.float64))
                 * torch.from_numpy(scale.astype(np.float64))[..., None]).reshape(shape)
            y = xhat @ w.T
            if offset is not None:
                y = y + s @ torch.from_numpy(offset.astype(np.float64)).T
            outs.append(y)
            continue
        if t in (GGMLType.Q8_0, GGMLType.Q5_0):  # centred codes, w = q d
            codes, scale = (q8_0_unpack if t == GGMLType.Q8_0 else q5_0_unpack)(raw, shape)
            w = (codes.double() * scale.double()[..., None]).reshape(shape)
            outs.append(xhat @ w.T)
            continue
        if t == GGMLType.Q4_1:
            codes, scale, m = q4_1_unpack(raw, shape)
            codes = codes.double()
        else:  # Q4_0: unpacked already centred (q - 8); the layout has m = -8 d
            codes, scale = q4_0_unpack(raw, shape)
            codes, m = codes.double() + 8, -8 * scale
        scale, m = scale.double(), m.double()
        # w = (q - 8) d + (m + 8 d): the first part sees x-hat, the second exact block sums
        centred = ((codes - 8) * scale[..., None]).reshape(shape)
        outs.append(xhat @ centred.T + s @ (m + 8 * scale).T)
    return torch.cat(outs, dim=-1)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_gemm_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = F.linear(x, w)
    # f32 dot products of length K: error <= ~K * eps * sum|w||x| in the worst case;
    # sqrt(K) * eps is the realistic scale and still far below any real bug.
    slack = (x.abs() @ w.abs().T) * (math.sqrt(x.shape[-1]) * 4 * torch.finfo(torch.float32).eps)
    assert torch.all((y - ref).abs() <= 1e-5 * ref.abs() + slack), (y - ref).abs().max()


def check_linear(lin: QuantLinear, parts, x: torch.Tensor) -> float:
    """Every path of ``lin`` on ``x`` against the oracle; returns the int8 path's error."""
    w = oracle_weight(parts)
    assert torch.equal(lin.dequantize(), w)  # repacking is lossless
    lin.gemm_min_m = GEMM_PATH
    assert_gemm_close(lin(x), x, w)
    lin.gemm_min_m = INT_PATH
    y = lin(x)
    exact = emulate_int_path(x, parts)
    row_scale = exact.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert torch.all((y.double() - exact).abs() <= 1e-5 * row_scale + 1e-30), \
        ((y.double() - exact).abs() / row_scale).max()
    err = rel_err(y, F.linear(x, w))
    assert err < REL_TOL_INT8, err
    lin.gemm_min_m = linear_mod.GEMM_MIN_M
    return err


# ------------------------------------------------------------ activation quantization


def test_activation_quantization_matches_emulation(ext) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 256) * torch.logspace(-3, 3, 7)[:, None]
    x[2, 32:64] = 0  # an all-zero block: d = 0, codes 0
    x[3, 0] = 1e4  # an outlier
    x[4, :32] = torch.arange(32) - 15.5  # exact .5 ties in x * 127 / max
    q, d, s, c8, qsum = ext.quantize_activations(x)
    eq, ed, es = emulate_quantize_x(x)
    assert torch.equal(q, eq)
    assert torch.equal(d, ed)
    assert torch.equal(qsum, eq.reshape(7, -1, 32).sum(-1, dtype=torch.int32))
    torch.testing.assert_close(s.double(), es, rtol=1e-5, atol=1e-5 * x.abs().max().item())
    # c8 = 8 (s - d * sum(q)): 8x the block's rounding error sum
    ec = 8 * (s.double() - d.double() * qsum.double())
    torch.testing.assert_close(c8.double(), ec, rtol=1e-4, atol=1e-5 * x.abs().max().item())


# -------------------------------------------------------------------- random blocks


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q5_0])
@pytest.mark.parametrize("m", MS)
def test_random_blocks(ext, qtype: GGMLType, m: int) -> None:
    rows, cols = 75, 320  # odd row count: exercises the row-tile tails
    parts = [(random_raw(qtype, rows, cols, seed=int(qtype)), qtype, (rows, cols))]
    lin = QuantLinear.from_raw(parts)
    torch.manual_seed(m)
    check_linear(lin, parts, torch.randn(m, cols))


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("m", MS)
def test_kquant_random_blocks_pack_exactly_as_k8(ext, qtype: GGMLType, m: int) -> None:
    rows, cols = 75, 512  # two 256-element super-blocks per row
    parts = [(random_kquant_raw(qtype, rows, cols, seed=int(qtype)), qtype, (rows, cols))]
    lin = QuantLinear.from_raw(parts)
    assert lin.bits == 16
    torch.manual_seed(m)
    check_linear(lin, parts, torch.randn(m, cols))


def test_a_layer_fusing_kquants_with_other_blocks_is_one_k8_layer(ext) -> None:
    """QKV of a Q4_K_M file: Q4_K, Q8_0, Q6_K (and Q4_1, Q5_0) rows in one k8 matrix."""
    cols = 256
    parts = [(random_kquant_raw(GGMLType.Q4_K, 24, cols, 1), GGMLType.Q4_K, (24, cols)),
             (random_raw(GGMLType.Q8_0, 8, cols, 2), GGMLType.Q8_0, (8, cols)),
             (random_kquant_raw(GGMLType.Q6_K, 16, cols, 3), GGMLType.Q6_K, (16, cols)),
             (random_raw(GGMLType.Q4_1, 8, cols, 4), GGMLType.Q4_1, (8, cols)),
             (random_raw(GGMLType.Q5_0, 8, cols, 5), GGMLType.Q5_0, (8, cols))]
    lin = QuantLinear.from_raw(parts)
    assert (lin.bits, lin.out_features) == (16, 64)
    torch.manual_seed(0)
    check_linear(lin, parts, torch.randn(5, cols))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K])
def test_a_rows_result_does_not_depend_on_the_thread_split(ext, qtype: GGMLType) -> None:
    """With AVX-512 the kernel computes two row groups per instruction and a lone group
    with 256-bit vectors; how the groups pair up follows the thread split. Each output
    must be the same to the bit either way (batch invariance rests on it)."""
    rows, cols = 75, 512  # 10 row groups: 1 thread pairs them all, 2 and 3 leave singles
    raw = (random_kquant_raw if qtype in K_TYPES else random_raw)(qtype, rows, cols, 7)
    lin = QuantLinear.from_raw([(raw, qtype, (rows, cols))])
    torch.manual_seed(0)
    x = torch.randn(16, cols)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(lin(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], y) for y in outs[1:])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0])
def test_heavy_tailed_and_zero_inputs(ext, qtype: GGMLType) -> None:
    rows, cols = 64, 256
    parts = [(random_raw(qtype, rows, cols, seed=5), qtype, (rows, cols))]
    lin = QuantLinear.from_raw(parts)
    torch.manual_seed(1)
    x = torch.distributions.StudentT(2.0).sample((9, cols))  # outliers in many blocks
    x[0] = 0  # a zero row gives exactly zero
    x[1, :64] = 0
    check_linear(lin, parts, x)
    lin.gemm_min_m = INT_PATH
    assert torch.equal(lin(x[:1]), torch.zeros(1, rows))


def test_fused_parts_and_shapes(ext) -> None:
    """QKV-style fusion of Q4_1 and Q4_0 parts; 3-D and non-contiguous inputs."""
    cols = 128
    parts = [(random_raw(GGMLType.Q4_1, 40, cols, 1), GGMLType.Q4_1, (40, cols)),
             (random_raw(GGMLType.Q4_0, 24, cols, 2), GGMLType.Q4_0, (24, cols)),
             (random_raw(GGMLType.Q4_1, 8, cols, 3), GGMLType.Q4_1, (8, cols))]
    lin = QuantLinear.from_raw(parts)
    assert (lin.out_features, lin.in_features, lin.bits) == (72, cols, 4)
    assert lin.nbytes == 72 * cols * 20 // 32  # 0.625 bytes per weight, like GGUF Q4_1
    odd = QuantLinear.from_raw(parts[:1] + [parts[2]])  # 48 rows
    assert odd.out_features == 48
    torch.manual_seed(0)
    x = torch.randn(2, 5, cols)
    check_linear(lin, parts, x.reshape(10, cols))
    y = lin(x)
    assert y.shape == (2, 5, 72)
    torch.testing.assert_close(y, lin(x.reshape(10, cols)).reshape(2, 5, 72), rtol=0, atol=0)
    xt = torch.randn(cols, 6).T  # non-contiguous
    torch.testing.assert_close(lin(xt), lin(xt.contiguous()), rtol=0, atol=0)


def test_a_non_block_type_cannot_be_packed() -> None:
    f16 = np.zeros((8, 64), np.float16).view(np.uint8).reshape(-1)
    with pytest.raises(UnsupportedModelError, match="no single quantized layout"):
        QuantLinear.from_raw([
            (random_raw(GGMLType.Q4_1, 8, 64, 1), GGMLType.Q4_1, (8, 64)),
            (f16, GGMLType.F16, (8, 64))])


# ------------------------------------------------------------------ real SmolLM2 tensors

SMOLLM2_LAYERS = [
    ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],  # fused QKV, Q4_1
    ["blk.7.ffn_gate.weight", "blk.7.ffn_up.weight"],  # fused gate/up
    ["blk.29.ffn_down.weight"],  # K = 1536
    ["token_embd.weight"],  # tied output head, Q8_0
]


@pytest.mark.parametrize("names", SMOLLM2_LAYERS, ids=lambda n: n[0])
def test_smollm2_tensors(ext, smollm2_file: GGUFFile, names: list[str]) -> None:
    lin = QuantFormat().linear(smollm2_file, names)
    assert isinstance(lin, QuantLinear)
    parts = [(smollm2_file.tensor_bytes(n), smollm2_file.tensor(n).ggml_type,
              smollm2_file.tensor(n).shape) for n in names]
    torch.manual_seed(0)
    errs = {}
    for m in MS:
        x = torch.randn(m, lin.in_features)
        errs[m] = check_linear(lin, parts, x)
    print(f"{names[0]}: int8-path relative error vs f32 by M: "
          + ", ".join(f"{m}: {e:.2e}" for m, e in errs.items()))


def test_smollm2_mixed_layer_is_one_k8_layer(ext, smollm2_file: GGUFFile) -> None:
    """Q4_1 rows fused with Q8_0 rows: one k8 matrix (the fused stack takes it), exact."""
    names = ["blk.0.attn_q.weight", "token_embd.weight"]  # Q4_1 then Q8_0, both K = 576
    lin = QuantFormat().linear(smollm2_file, names)
    assert isinstance(lin, QuantLinear) and lin.bits == 16
    parts = [(smollm2_file.tensor_bytes(n), smollm2_file.tensor(n).ggml_type,
              smollm2_file.tensor(n).shape) for n in names]
    torch.manual_seed(0)
    check_linear(lin, parts, torch.randn(3, 576))


def test_a_dense_part_falls_back_to_concat(ext) -> None:
    f16 = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float16)
    parts = [(random_raw(GGMLType.Q4_1, 8, 64, 1), GGMLType.Q4_1, (8, 64)),
             (f16.view(np.uint8).reshape(-1), GGMLType.F16, (8, 64))]
    lin = QuantFormat().linear_from_raw(parts, ["q", "f"])
    assert isinstance(lin, ConcatLinear)
    for part in lin.parts:
        part.gemm_min_m = GEMM_PATH  # f32-exact path, so the oracle check is tight
    x = torch.randn(80, 64)
    assert_gemm_close(lin(x), x, oracle_weight(parts))


def test_gemma3_q5_0_projection_packs_8_bit_exactly(ext, gemma3_file: GGUFFile) -> None:
    name = "blk.0.attn_q.weight"
    info = gemma3_file.tensor(name)
    assert info.ggml_type == GGMLType.Q5_0
    lin = QuantFormat().linear(gemma3_file, [name])
    assert isinstance(lin, QuantLinear) and lin.bits == 8
    parts = [(gemma3_file.tensor_bytes(name), info.ggml_type, info.shape)]
    torch.manual_seed(0)
    check_linear(lin, parts, torch.randn(3, info.shape[1]))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K])
def test_gemma3_kquant_matrices_pack_exactly(ext, gemma3_file: GGUFFile, qtype) -> None:
    name = next(n for n, t in gemma3_file.tensors.items()
                if t.ggml_type == qtype and len(t.shape) == 2)
    info = gemma3_file.tensor(name)
    lin = QuantFormat().linear(gemma3_file, [name])
    assert isinstance(lin, QuantLinear) and lin.bits == 16
    torch.manual_seed(0)
    check_linear(lin, [(gemma3_file.tensor_bytes(name), qtype, info.shape)],
                 torch.randn(3, info.shape[1]))


def test_float_matrices_stay_dense() -> None:
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float16)
    lin = QuantFormat().linear_from_raw([(w.view(np.uint8).reshape(-1), GGMLType.F16, (8, 64))],
                                        ["f16"])
    assert isinstance(lin, DenseLinear) and lin.weight.dtype == torch.float32


def test_unavailable_kernel_raises_clearly(monkeypatch, smollm2_file: GGUFFile) -> None:
    monkeypatch.setattr(kernels, "quant_matmul", lambda: None)
    monkeypatch.setattr(kernels, "_error", "test: compiler missing")
    with pytest.raises(UnsupportedModelError, match="native quantized-matmul kernel.*compiler"):
        QuantFormat().linear(smollm2_file, ["blk.0.attn_output.weight"])


def test_kernel_isa_choice(monkeypatch) -> None:
    monkeypatch.setenv("EMBER_KERNEL_ISA", "avx2")
    assert kernels._variants() == (("ember_quant_matmul_avx2", ["-mavx2", "-mfma", "-mf16c"]),)
    monkeypatch.setenv("EMBER_KERNEL_ISA", "native")
    assert kernels._variants()[0] == ("ember_quant_matmul", ["-march=native"])
    monkeypatch.setenv("EMBER_KERNEL_ISA", "avx9")
    with pytest.raises(RuntimeError, match="EMBER_KERNEL_ISA='avx9'"):
        kernels._variants()


# -------------------------------------------------------- other SIMD builds of the source


@pytest.fixture
def tiny_q4_model(tiny_loaded_q4):
    return tiny_loaded_q4.model


@pytest.mark.slow
@pytest.mark.parametrize("variant,flags", [("scalar", []), ("avx2", ["-mavx2", "-mfma", "-mf16c"])])
def test_other_simd_builds_agree(ext, variant: str, flags: list[str], tiny_q4_model) -> None:
    """The scalar fallback and the plain-AVX2 (no VNNI) path give the native build's results."""
    name = f"ember_qmm_test_{variant}"
    try:  # cached next to the real build (same source/CPU/torch key), so reruns are quick
        mod = kernels.compile_quant_matmul(name, flags, kernels._build_root() / name)
    except Exception as e:  # e.g. a compiler without AVX2 support
        pytest.skip(f"could not build the {variant} variant: {e}")
    assert mod.simd() == variant
    cols = 320
    p4 = (random_raw(GGMLType.Q4_1, 75, cols, 9), GGMLType.Q4_1, (75, cols))
    p8 = (random_raw(GGMLType.Q8_0, 75, cols, 9), GGMLType.Q8_0, (75, cols))
    q4, q8 = QuantLinear.from_raw([p4]), QuantLinear.from_raw([p8])
    raw4 = [torch.from_numpy(np.ascontiguousarray(a)) for a in linear_mod.pack_q4(*p4)]
    raw8 = [torch.from_numpy(np.ascontiguousarray(a)) for a in linear_mod.pack_q8(*p8)]
    torch.manual_seed(0)
    # the native build packed these; packing is plain tensor shuffling, the same in both
    assert all(torch.equal(a, b) for a, b in zip(mod.q4_pack(*raw4), q4.packed, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(mod.q8_pack(*raw8), q8.packed, strict=True))
    for m in MS:
        x = torch.randn(m, cols)
        for gm in (INT_PATH, GEMM_PATH):
            ref4 = ext.q4_matmul(x, *q4.packed, 75, gm)
            ref8 = ext.q8_matmul(x, *q8.packed, 75, gm)
            torch.testing.assert_close(mod.q4_matmul(x, *q4.packed, 75, gm), ref4,
                                       rtol=1e-5, atol=1e-5 * ref4.abs().amax().item())
            torch.testing.assert_close(mod.q8_matmul(x, *q8.packed, 75, gm), ref8,
                                       rtol=1e-5, atol=1e-5 * ref8.abs().amax().item())
    assert torch.equal(mod.q4_dequantize(*q4.packed, 75, cols), q4.dequantize())
    assert torch.equal(mod.q8_dequantize(*q8.packed, 75, cols), q8.dequantize())
    # attention over the pool in place (f32 and f16 pools), tokens of three rows
    for dtype in (torch.float32, torch.float16):
        pool = torch.randn(12, 2, 2, 16, 2, 64).to(dtype)  # blocks, layers, K/V, pos, heads, dim
        tables = torch.tensor([[3, 7, 1], [0, 11, 5], [9, 2, 4]])
        rows, positions = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([39, 12, 0, 32, 47])
        args = (torch.randn(5, 6, 64), pool, 1, tables, rows, positions, 0.125)
        torch.testing.assert_close(mod.paged_attention(*args), ext.paged_attention(*args),
                                   rtol=1e-5, atol=1e-6)
    # the fused decoder stack of each build over the same packed weights
    from ember.models.decoder import native_decoder

    tiny = tiny_q4_model
    ours = native_decoder(tiny.cfg, tiny.layers, ext=mod)
    ids = list(range(100, 140))
    native_logits = tiny.score(ids)
    saved, tiny.native = tiny.native, ours
    try:
        variant_logits = tiny.score(ids)
    finally:
        tiny.native = saved
    torch.testing.assert_close(variant_logits, native_logits, rtol=1e-3, atol=1e-3)
    qa, da, sa, ca, ia = mod.quantize_activations(x)
    qb, db, sb, cb, ib = ext.quantize_activations(x)
    assert torch.equal(qa, qb) and torch.equal(da, db) and torch.equal(ia, ib)
    # float block sums: only the order of 32 additions differs (c8 is 8x a difference of them)
    xmax = x.abs().max().item()
    torch.testing.assert_close(sa, sb, rtol=0, atol=1e-5 * xmax)
    torch.testing.assert_close(ca, cb, rtol=0, atol=1e-4 * xmax)
    # k8 (K-quants with their f32 half-block scales and offsets)
    kq = [(random_kquant_raw(GGMLType.Q4_K, 24, 512, 3), GGMLType.Q4_K, (24, 512)),
          (random_kquant_raw(GGMLType.Q6_K, 16, 512, 4), GGMLType.Q6_K, (16, 512))]
    k8 = QuantLinear.from_raw(kq)
    xk = torch.randn(5, 512)
    for gm in (INT_PATH, GEMM_PATH):
        torch.testing.assert_close(mod.k8_matmul(xk, *k8.packed, 40, gm),
                                   ext.k8_matmul(xk, *k8.packed, 40, gm), rtol=1e-5, atol=1e-5)
    assert torch.equal(mod.k8_dequantize(*k8.packed, 40, 512), k8.dequantize())


# -------------------------------------------------------------------------- end to end

TEXT = (
    "The lighthouse stood at the edge of the harbour for nearly two hundred years. "
    "Its keepers kept careful logs of every ship that passed, the direction of the "
    "wind, and the height of the tide each morning and evening. When the lamp was "
    "finally automated in the middle of the last century, the town council debated "
    "whether the old building should become a museum or be sold to a private owner. "
    "In the end a group of volunteers raised enough money to restore the tower, "
    "repaint the iron gallery, and open a small exhibition about the families who had "
    "lived there. Visitors can now climb the spiral staircase, look at the original "
    "lens, and read the handwritten notes about storms, shipwrecks and rescues. On "
    "clear days the view stretches across the bay to the mountains in the north, and "
    "children are often surprised to learn that the light can still be seen from more "
    "than twenty miles away at sea. The museum is open every day except Monday, and "
    "entry is free for residents of the town."
)


@pytest.mark.slow
def test_end_to_end_agreement_with_f32(ext) -> None:
    """Teacher-forced logits of q4 vs f32: the fused native stack (int8 activations),
    and the op-by-op path with every linear on the dequantize + GEMM path (the stack
    always uses the int8 kernels, so it is switched off for that one)."""
    from ember.models.loader import load_model

    f32 = load_model("smollm2-135m", "f32")
    q4 = load_model("smollm2-135m", "q4")
    ids = f32.tokenizer.encode(TEXT, add_bos=f32.tokenizer.add_bos)
    assert len(ids) >= 180
    ref = f32.model.score(ids)
    logp_ref = ref.log_softmax(-1)

    quant_layers = [lin for layer in q4.model.layers for lin in
                    (layer.qkv, layer.o, layer.gate_up, layer.down)] + [q4.model.output]
    assert all(isinstance(lin, QuantLinear) for lin in quant_layers)
    assert q4.model.output.bits == 8  # SmolLM2's tied Q8_0 head stays 8-bit
    results = {}
    stack = q4.model.native
    assert stack is not None
    for path, gm in (("int8", INT_PATH), ("gemm", GEMM_PATH)):
        for lin in quant_layers:
            lin.gemm_min_m = gm
        q4.model.native = stack if path == "int8" else None
        logits = q4.model.score(ids)
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = (logp_ref.exp() * (logp_ref - logits.log_softmax(-1))).sum(-1).mean().item()
        results[path] = (agree, kl)
        print(f"q4 {path} path vs f32 over {len(ids)} positions: top-1 agreement "
              f"{agree:.1%}, mean KL {kl:.2e} nats")
    for lin in quant_layers:
        lin.gemm_min_m = linear_mod.GEMM_MIN_M
    q4.model.native = stack
    agree, kl = results["int8"]
    assert agree >= 0.90 and kl < 0.02, results
    agree, kl = results["gemm"]  # same weights, f32 arithmetic: only summation order differs
    assert agree >= 0.99 and kl < 1e-4, results


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_native_rms_norm_matches_torch(ext, rows: int) -> None:
    x = torch.randn(rows, 576) * 3
    w = torch.randn(576)
    expected = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(ext.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-6)
