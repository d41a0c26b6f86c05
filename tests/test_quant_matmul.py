"""The native quantized-matmul kernels (ember/kernels) and the ``q4`` weight format.

Oracles: gguf-py's dequantizer (an implementation nobody here wrote) for the packed
layouts, and ``F.linear`` in float32 over those weights for the products.

Every block type with a packed layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS, MXFP4) is checked the same ways:

* Layout: packing moves bits, never values: the packed weight dequantizes to exactly
  gguf-py's floats, and it holds the GGUF's bytes (no more: rows padded to 16 only).

* GEMM path (M >= gemm_min_m; off by default, an exact-prefill option): weights are
  dequantized to f32 in chunks and multiplied by BLAS. The dequantized weights are
  bit-identical to the oracle's and the product is the same f32 GEMM, so the result
  must agree to f32 rounding (``rtol=1e-5`` plus a K-scaled absolute slack for
  cancellation).

* Integer path (the default for every M): activations are quantized per 32 to int8
  (d = max|x|/127, round half to even) like llama.cpp's Q8 activations. That is an
  approximation, checked two ways:
  1. exactly: an independent float64 emulation of the same arithmetic (same int8
     codes, exact integer dots, a block's offset taken against the exact float block
     sums) must match to f32 accumulation error (relative 1e-5 of the row scale);
  2. against the f32 oracle: the relative Frobenius error ||y - y_ref|| / ||y_ref||.
     Rounding x to 1/127 of its block max gives per-element error ~ max|x|/127/sqrt(12),
     about 0.5% of x's rms for Gaussian blocks; with centred weight codes the output
     error is the same fraction of the output, so we see 0.2-0.7% and assert < 2%.
  And batch invariance: a row's outputs are the same bits alone and in any batch.
  End to end (real text, teacher forced) the int8 path must keep >= 90% top-1
  agreement with f32 and a mean KL(f32 || q4) < 0.02 nats; observed values are printed.

The kernels must build here: ``ext`` fails (does not skip) when they do not.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from native import SIMD_VARIANTS, build_variant, require_kernels, score_with_stack

from ember import kernels
from ember.errors import GGUFError, UnsupportedModelError
from ember.models import linear as linear_mod
from ember.models.gguf import BLOCK_GEOMETRY, GGMLType, GGUFFile
from ember.models.linear import (
    PACKED_TYPES,
    ConcatLinear,
    DenseLinear,
    PackedEmbedding,
    QuantFormat,
    QuantLinear,
)
from ember.models.quant import dequantize, unpack_affine

MS = [1, 3, 16, 64, 300]
INT_PATH = 10**9  # gemm_min_m that keeps every M on the integer path (the default)
GEMM_PATH = 0  # gemm_min_m that sends every M to the dequantize + GEMM path
REL_TOL_INT8 = 2e-2
LEGACY = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]
K_TYPES = [GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
# table-valued indices, per-32 activations
IQ_TYPES = [GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4]
# types whose random blocks are random bytes with sane f16 scales (tests/tiny_model.py)
RANDOM_BLOCK_TYPES = [GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.Q3_K]
ALL_TYPES = LEGACY + K_TYPES + IQ_TYPES


@pytest.fixture(scope="module")
def ext():
    return require_kernels()


# ----------------------------------------------------------------------- helpers


def random_raw(qtype: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF bytes of a random [rows, cols] matrix quantized by gguf-py (the reference)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w += rng.standard_normal((rows, cols // 32, 1)).astype(np.float32).repeat(32, -1).reshape(
        rows, cols) * 0.02  # per-block offsets, so Q4_1's m matters
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(qtype))).reshape(-1)


def random_kquant_raw(qtype: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize to K-quants): random code and
    scale bytes, with the f16 super-scales set to sane magnitudes."""
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


def random_block_raw(qtype: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a type gguf-py cannot quantize (IQ4_*, Q3_K): random code and
    sub-scale bytes, the f16 scale set as tests/tiny_model.py sets it."""
    from tiny_model import RANDOM_BLOCK_SCALES

    rng = np.random.default_rng(seed)
    elems, size = BLOCK_GEOMETRY[qtype]
    blk = rng.integers(0, 256, (rows * cols // elems, size), dtype=np.uint8)
    for at, share in RANDOM_BLOCK_SCALES[gguf.GGMLQuantizationType(int(qtype))]:
        d = rng.uniform(0.5, 1.5, len(blk)) * 0.05 * share
        blk[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blk.reshape(-1)


def random_mxfp4_raw(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random MXFP4 codes under exponents from the subnormal halves (e < 2) to 2^1: every
    path of the scale decode, finite products."""
    rng = np.random.default_rng(seed)
    blk = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
    blk[:, 0] = rng.integers(0, 130, len(blk), dtype=np.uint8)
    blk[::7, 0] = rng.integers(0, 2, len(blk[::7]), dtype=np.uint8)
    return blk.reshape(-1)


def any_raw(qtype: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    if qtype == GGMLType.MXFP4:
        return random_mxfp4_raw(rows, cols, seed)
    make = (random_block_raw if qtype in RANDOM_BLOCK_TYPES else
            random_kquant_raw if qtype in K_TYPES else random_raw)
    return make(qtype, rows, cols, seed)


def gguf_py_weight(parts) -> torch.Tensor:
    """The parts dequantized by gguf-py (the independent oracle), row-concatenated."""
    return torch.cat([torch.from_numpy(gguf.quants.dequantize(
        np.asarray(raw).reshape(shape[0], -1), gguf.GGMLQuantizationType(int(t)))).float()
        for raw, t, shape in parts])


def emulate_quantize_x(x: torch.Tensor):
    """float32 emulation of the kernel's activation quantization: codes, d, block sums."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127.0
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # round half to even, like cvtps/nearbyint
    return q.to(torch.int8).reshape(x.shape), d, xb.double().sum(-1)


def emulate_quantize_x_k(x: torch.Tensor):
    """The same per 256 (K-quants' activations): codes, d, code sums per 16."""
    xb = x.reshape(x.shape[0], -1, 256)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).to(torch.int8)
    return (q.reshape(x.shape), amax / 127.0,
            q.reshape(x.shape[0], -1, 16).sum(-1, dtype=torch.int32))


# the code a legacy block's codes are centred on (the kernel's z): symmetric types'
# centre is part of their unpacked codes already; offset types keep it apart
CENTRE = {GGMLType.Q4_1: 8, GGMLType.Q5_1: 16}


def emulate_int_path(x: torch.Tensor, parts) -> torch.Tensor:
    """Float64 model of the integer path, built from quant.py's unpackers.

    K-quants: exactly sum w x-hat, x-hat the activations quantized per 256. Legacy
    types, per 32-element block of weights w = q a + b (b = 0 for symmetric codes) and
    activations x with codes x_q, scale d_x, exact sum s: sum_i (w_i - mu) d_x x_q,i
    + mu s with mu = z a + b, the block's centre value (sum w x-hat for symmetric
    codes)."""
    q, d, s = emulate_quantize_x(x)
    xhat = (q.double().reshape(x.shape[0], -1, 32) * d.double()[..., None]).reshape(x.shape)
    outs = []
    for raw, t, shape in parts:
        codes, scale, offset = unpack_affine(raw, t, shape)
        w = torch.from_numpy(dequantize(raw, t, shape).numpy().astype(np.float64))
        if t in K_TYPES:
            qk, dk, _ = emulate_quantize_x_k(x)
            xk = (qk.double().reshape(x.shape[0], -1, 256) * dk.double()[..., None])
            outs.append(xk.reshape(x.shape) @ w.T)
            continue
        if offset is None:
            outs.append(xhat @ w.T)
            continue
        mu = torch.from_numpy(CENTRE[t] * scale.astype(np.float64) + offset.astype(np.float64))
        centred = w - mu.repeat_interleave(32, dim=1)
        outs.append(xhat @ centred.T + s @ mu.T)
    return torch.cat(outs, dim=-1)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_gemm_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = F.linear(x, w)
    # f32 dot products of length K: error <= ~K * eps * sum|w||x| in the worst case;
    # sqrt(K) * eps is the realistic scale and still far below any real bug.
    slack = (x.abs() @ w.abs().T) * (math.sqrt(x.shape[-1]) * 4 * torch.finfo(torch.float32).eps)
    assert torch.all((y - ref).abs() <= 1e-5 * ref.abs() + slack), (y - ref).abs().max()


def assert_int_path_exact(y: torch.Tensor, x: torch.Tensor, parts) -> None:
    """``y`` is the integer path's result for ``x``: the float64 emulation's to 1e-5 of
    each row's largest output."""
    exact = emulate_int_path(x, parts)
    row_scale = exact.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert torch.all((y.double() - exact).abs() <= 1e-5 * row_scale + 1e-30), \
        ((y.double() - exact).abs() / row_scale).max()


def check_linear(lin: QuantLinear, parts, x: torch.Tensor) -> float:
    """Every path of ``lin`` on ``x`` against the oracles; returns the int8 path's error."""
    w = gguf_py_weight(parts)
    assert torch.equal(lin.dequantize(), w)  # packing is lossless
    lin.gemm_min_m = GEMM_PATH
    assert_gemm_close(lin(x), x, w)
    lin.gemm_min_m = INT_PATH
    y = lin(x)
    assert_int_path_exact(y, x, parts)
    err = rel_err(y, F.linear(x, w))
    assert err < REL_TOL_INT8, err
    # batch invariance: each row alone gives the same bits as in the batch
    for i in {0, x.shape[0] // 2, x.shape[0] - 1}:
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1])
    lin.gemm_min_m = linear_mod.GEMM_MIN_M
    return err


# ------------------------------------------------------------ activation quantization


def test_activation_quantization_matches_emulation(ext) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 256) * torch.logspace(-3, 3, 7)[:, None]
    x[2, 32:64] = 0  # an all-zero block: d = 0, codes 0
    x[3, 0] = 1e4  # an outlier
    x[4, :32] = torch.arange(32) - 15.5  # exact .5 ties in x * 127 / max
    q, d, s, c, qsum, qlo = ext.quantize_activations(x)
    eq, ed, es = emulate_quantize_x(x)
    assert torch.equal(q, eq)
    assert torch.equal(d, ed)
    blocks = eq.reshape(7, -1, 32)
    assert torch.equal(qsum, blocks.sum(-1, dtype=torch.int32))
    assert torch.equal(qlo, blocks[..., :16].sum(-1, dtype=torch.int32))
    torch.testing.assert_close(s.double(), es, rtol=1e-5, atol=1e-5 * x.abs().max().item())
    # c = s - d * sum(q): the block's rounding error sum
    ec = s.double() - d.double() * qsum.double()
    torch.testing.assert_close(c.double(), ec, rtol=1e-4, atol=1e-6 * x.abs().max().item())


def test_kquant_activation_quantization_matches_emulation(ext) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 512) * torch.logspace(-2, 2, 5)[:, None]
    x[1, 256:] = 0  # an all-zero super-block
    x[2, 7] = 1e4  # an outlier flattens its super-block
    x[3, :256] = (torch.arange(256) - 127.5) / 127.5  # .5 ties in x * 127 / max
    q, d, bsum = ext.quantize_activations_k(x)
    eq, ed, ebsum = emulate_quantize_x_k(x)
    assert torch.equal(q, eq) and torch.equal(d, ed) and torch.equal(bsum, ebsum)


# -------------------------------------------------------------------- random blocks


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", MS)
def test_random_blocks(ext, qtype: GGMLType, m: int) -> None:
    # odd row count: exercises padded groups and row-tile tails; K: two super-blocks
    rows, cols = 75, 512
    parts = [(any_raw(qtype, rows, cols, seed=int(qtype)), qtype, (rows, cols))]
    lin = QuantLinear.from_raw(parts)
    assert lin.types == [qtype]
    torch.manual_seed(m)
    check_linear(lin, parts, torch.randn(m, cols))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_packed_weights_hold_the_gguf_bytes(ext, qtype: GGMLType) -> None:
    """Layouts read no more bytes than the GGUF: a whole number of 16-row groups holds
    exactly the file's bytes (the scalar/SIMD kernels read nothing else)."""
    rows, cols = 48, 1024
    raw = any_raw(qtype, rows, cols, seed=3)
    lin = QuantLinear.from_raw([(raw, qtype, (rows, cols))])
    assert lin.nbytes == raw.nbytes


def test_mxfp4_every_exponent_packs_to_gguf_pys_floats(ext) -> None:
    """Random MXFP4 bytes with every finite E8M0 exponent (the subnormal halves of e < 2
    included) and every code: the packed layout dequantizes to gguf-py's floats bit for
    bit, and the kernel multiplies by them (a quantizer's output spans only a few
    exponents)."""
    rng = np.random.default_rng(41)
    raw = rng.integers(0, 256, size=(32, 16, 17), dtype=np.uint8)
    raw[..., 0] = np.arange(32 * 16).reshape(32, 16) % 255  # 0..254: 255 is NaN
    parts = [(raw.reshape(-1), GGMLType.MXFP4, (32, 16 * 32))]
    lin = QuantLinear.from_raw(parts)
    with np.errstate(over="ignore"):  # 12 * 2^126 is inf in f32, on both sides
        want = gguf_py_weight(parts)
    assert lin.dequantize().view(torch.int32).equal(want.view(torch.int32))
    # and the kernel's own decode of the exponents (vector, subnormals included), on
    # scales small enough that the products stay finite
    raw[..., 0] = np.arange(32 * 16).reshape(32, 16) % 141
    parts = [(raw.reshape(-1), GGMLType.MXFP4, (32, 16 * 32))]
    check_linear(QuantLinear.from_raw(parts), parts, torch.randn(3, 16 * 32))
    raw[..., 0] = np.arange(32 * 16).reshape(32, 16) % 2  # only the subnormal halves
    parts = [(raw.reshape(-1), GGMLType.MXFP4, (32, 16 * 32))]
    check_linear(QuantLinear.from_raw(parts), parts, torch.randn(3, 16 * 32) * 1e30)


def test_a_layer_fusing_different_block_types_is_one_packed_layer(ext) -> None:
    """QKV of a Q4_K_M file: Q4_K, Q4_K and Q6_K rows (and Q8_0, Q4_1, Q5_0 beside
    them) in one layer, each part in its own layout, one matmul."""
    cols = 256
    types = [GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.Q4_1, GGMLType.Q5_0,
             GGMLType.Q5_K, GGMLType.Q4_0, GGMLType.Q5_1]
    parts = [(any_raw(t, 8 + 8 * i, cols, i), t, (8 + 8 * i, cols)) for i, t in enumerate(types)]
    lin = QuantLinear.from_raw(parts)
    assert lin.types == types
    assert lin.out_features == sum(8 + 8 * i for i in range(len(types)))
    torch.manual_seed(0)
    check_linear(lin, parts, torch.randn(5, cols))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K],
                         ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_thread_split(ext, qtype: GGMLType) -> None:
    """Threads take contiguous ranges of row groups; how many there are moves the
    boundaries. Each output must be the same to the bit either way (batch invariance
    rests on it)."""
    rows, cols = 150, 512
    lin = QuantLinear.from_raw([(any_raw(qtype, rows, cols, 7), qtype, (rows, cols))])
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


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_K],
                         ids=lambda t: t.name)
def test_heavy_tailed_and_zero_inputs(ext, qtype: GGMLType) -> None:
    rows, cols = 64, 256
    parts = [(any_raw(qtype, rows, cols, seed=5), qtype, (rows, cols))]
    lin = QuantLinear.from_raw(parts)
    torch.manual_seed(1)
    x = torch.distributions.StudentT(2.0).sample((9, cols))  # outliers in many blocks
    x[0] = 0  # a zero row gives exactly zero
    x[1, :64] = 0
    check_linear(lin, parts, x)
    lin.gemm_min_m = INT_PATH
    assert torch.equal(lin(x[:1]), torch.zeros(1, rows))


# the bytes of a K-quant block that hold codes and sub-block scales (not its f16 scales)
K_CODE_BYTES = {GGMLType.Q3_K: slice(0, 108), GGMLType.Q4_K: slice(4, 144),
                GGMLType.Q5_K: slice(4, 176), GGMLType.Q6_K: slice(0, 192)}
Q6K_SCALES = slice(192, 208)  # int8: 0x80 = -128, the largest magnitude


def extreme_k_linear(qtype: GGMLType, rows: int = 40, cols: int = 512):
    """Every code at its largest and every scale at its largest magnitude (40 rows: the
    last group's second half is empty), with activations whose codes are all +127 or
    all -127, alternating in sign, or a ramp."""
    blk = any_raw(qtype, rows, cols, seed=9).reshape(-1, BLOCK_GEOMETRY[qtype][1])
    blk[:, K_CODE_BYTES[qtype]] = 0xFF
    if qtype == GGMLType.Q6_K:
        blk[:, Q6K_SCALES] = 0x80
    parts = [(blk.reshape(-1), qtype, (rows, cols))]
    x = torch.ones(10, cols)
    x[4:8] = -1
    x[8, ::2] = -1  # signs alternating within every pair
    x[9] = torch.linspace(-1, 1, cols)
    return QuantLinear.from_raw(parts), parts, x


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_extreme_codes_and_activations_stay_exact(ext, qtype: GGMLType) -> None:
    """The kernels add vpmaddubsw products up in int16 for as long as they cannot
    overflow; an overflow here would wrap a row's sum (this build's lanes)."""
    check_linear(*extreme_k_linear(qtype))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["avx2", "avx2vnni"])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_extreme_codes_stay_exact_on_the_avx2_lanes(ext, qtype: GGMLType, variant: str) -> None:
    """The same on the 256-bit builds, whose tiles a native build of an AVX-512 machine
    never runs: plain AVX2 (int16 sums, EMBER_SUM16) and AVX2 with VNNI (four-row K-quant
    tiles): against the float64 emulation, and each row alone gives the same bits as in
    the batch."""
    mod = build_variant(variant)
    lin, parts, x = extreme_k_linear(qtype)
    other = mod.PackedLinear(lin.in_features, lin.packed.segments)
    y = other.matmul(x, INT_PATH)
    assert_int_path_exact(y, x, parts)
    for i in range(x.shape[0]):
        assert torch.equal(other.matmul(x[i:i + 1], INT_PATH), y[i:i + 1])


def test_fused_parts_and_shapes(ext) -> None:
    """QKV-style fusion of Q4_1 and Q4_0 parts; 3-D and non-contiguous inputs."""
    cols = 128
    parts = [(random_raw(GGMLType.Q4_1, 40, cols, 1), GGMLType.Q4_1, (40, cols)),
             (random_raw(GGMLType.Q4_0, 24, cols, 2), GGMLType.Q4_0, (24, cols)),
             (random_raw(GGMLType.Q4_1, 8, cols, 3), GGMLType.Q4_1, (8, cols))]
    lin = QuantLinear.from_raw(parts)
    assert (lin.out_features, lin.in_features) == (72, cols)
    torch.manual_seed(0)
    x = torch.randn(2, 5, cols)
    check_linear(lin, parts, x.reshape(10, cols))
    y = lin(x)
    assert y.shape == (2, 5, 72)
    torch.testing.assert_close(y, lin(x.reshape(10, cols)).reshape(2, 5, 72), rtol=0, atol=0)
    xt = torch.randn(cols, 6).T  # non-contiguous
    torch.testing.assert_close(lin(xt), lin(xt.contiguous()), rtol=0, atol=0)


def test_packing_refuses_what_it_cannot_hold(ext) -> None:
    f16 = np.zeros((8, 64), np.float16).view(np.uint8).reshape(-1)
    with pytest.raises(UnsupportedModelError, match="'f'.*F16 has no packed layout"):
        QuantLinear.from_raw([
            (random_raw(GGMLType.Q4_1, 8, 64, 1), GGMLType.Q4_1, (8, 64)),
            (f16, GGMLType.F16, (8, 64))], ["q", "f"])
    with pytest.raises(GGUFError, match="'short'.*needs 544 bytes, got 543"):
        QuantLinear.from_raw([(random_raw(GGMLType.Q8_0, 8, 64, 1)[:-1], GGMLType.Q8_0,
                               (8, 64))], ["short"])
    with pytest.raises(UnsupportedModelError, match="'b': 128 columns.*64"):
        QuantLinear.from_raw([(random_raw(GGMLType.Q8_0, 8, 64, 1), GGMLType.Q8_0, (8, 64)),
                              (random_raw(GGMLType.Q8_0, 8, 128, 1), GGMLType.Q8_0, (8, 128))],
                             ["a", "b"])
    with pytest.raises(RuntimeError, match="multiple of its block size 256"):
        ext.packed_nbytes(int(GGMLType.Q4_K), 16, 320)


# ------------------------------------------------------------------ real SmolLM2 tensors

SMOLLM2_LAYERS = [
    ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],  # fused QKV, Q4_1
    ["blk.7.ffn_gate.weight", "blk.7.ffn_up.weight"],  # fused gate/up
    ["blk.29.ffn_down.weight"],  # K = 1536
    ["token_embd.weight"],  # tied output head, Q8_0
    ["blk.0.attn_q.weight", "token_embd.weight"],  # Q4_1 then Q8_0 rows in one layer
]


@pytest.mark.slow
@pytest.mark.parametrize("names", SMOLLM2_LAYERS, ids=lambda n: "+".join(n))
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


def test_a_dense_part_falls_back_to_concat(ext) -> None:
    f16 = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float16)
    parts = [(random_raw(GGMLType.Q4_1, 8, 64, 1), GGMLType.Q4_1, (8, 64)),
             (f16.view(np.uint8).reshape(-1), GGMLType.F16, (8, 64))]
    lin = QuantFormat().linear_from_raw(parts, ["q", "f"])
    assert isinstance(lin, ConcatLinear)
    for part in lin.parts:
        part.gemm_min_m = GEMM_PATH  # f32-exact path, so the oracle check is tight
    x = torch.randn(80, 64)
    assert_gemm_close(lin(x), x, gguf_py_weight(parts))


@pytest.mark.parametrize("qtype", [GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K],
                         ids=lambda t: t.name)
def test_gemma3_matrices_pack_exactly(ext, gemma3_file: GGUFFile, qtype) -> None:
    name = next(n for n, t in gemma3_file.tensors.items()
                if t.ggml_type == qtype and len(t.shape) == 2 and n != "token_embd.weight")
    info = gemma3_file.tensor(name)
    lin = QuantFormat().linear(gemma3_file, [name])
    assert isinstance(lin, QuantLinear) and lin.types == [qtype]
    torch.manual_seed(0)
    check_linear(lin, [(gemma3_file.tensor_bytes(name), qtype, info.shape)],
                 torch.randn(3, info.shape[1]))


def test_a_tied_head_serves_the_embedding_rows_exactly(ext, smollm2_file: GGUFFile) -> None:
    name = "token_embd.weight"
    emb = QuantFormat().embedding(smollm2_file, name, tied=True)
    assert isinstance(emb, PackedEmbedding) and isinstance(emb.tied_linear(), QuantLinear)
    ids = torch.tensor([0, 1, 2, 17, 49151, 17])
    info = smollm2_file.tensor(name)
    rows = gguf.quants.dequantize(smollm2_file.tensor_bytes(name).reshape(info.shape[0], -1),
                                  gguf.GGMLQuantizationType(info.ggml_type))[ids.numpy()]
    assert torch.equal(emb(ids), torch.from_numpy(rows).float())
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([49152]))
    untied = QuantFormat().embedding(smollm2_file, name)
    assert not isinstance(untied, PackedEmbedding)  # read from the mapping, never packed
    assert torch.equal(untied(ids), emb(ids))


def test_a_bound_format_packs_the_weights_back_to_back_in_one_arena(
        ext, smollm2_file: GGUFFile) -> None:
    """QuantFormat.bind(gguf): one huge-page reservation for the model's weights, blobs
    carved in order (64-byte aligned, never overlapping), the same bytes as unbound."""
    fmt = QuantFormat().bind(smollm2_file)
    arena = fmt._arena._buf
    names = [["blk.0.attn_q.weight", "blk.0.attn_k.weight"], ["blk.0.ffn_down.weight"],
             ["blk.1.attn_output.weight"]]
    spans = []
    for group in names:
        lin = fmt.linear(smollm2_file, group)
        alone = QuantFormat().linear(smollm2_file, group)
        for (_, _, blob), (_, _, ref) in zip(lin.packed.segments, alone.packed.segments,
                                             strict=True):
            assert blob.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
            assert torch.equal(blob, ref)
            start = blob.data_ptr() - arena.data_ptr()
            assert start % 64 == 0
            spans.append((start, start + blob.numel()))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # in order
    emb = fmt.embedding(smollm2_file, "token_embd.weight", tied=True)
    (_, _, head), = emb.tied_linear().packed.segments
    assert head.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_an_arena_that_is_full_hands_out_ordinary_memory(ext) -> None:
    arena = linear_mod.WeightArena(100)
    first, second = arena(64), arena(64)  # the second would end at byte 128
    assert first.untyped_storage().data_ptr() == arena._buf.untyped_storage().data_ptr()
    assert second.untyped_storage().data_ptr() != arena._buf.untyped_storage().data_ptr()
    assert first.numel() == second.numel() == 64


def test_float_matrices_stay_dense() -> None:
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float16)
    lin = QuantFormat().linear_from_raw([(w.view(np.uint8).reshape(-1), GGMLType.F16, (8, 64))],
                                        ["f16"])
    assert isinstance(lin, DenseLinear) and lin.weight.dtype == torch.float32


def test_every_packed_type_is_tested() -> None:
    assert set(PACKED_TYPES) == set(ALL_TYPES)


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


def test_describe_names_the_build_that_is_loaded(monkeypatch) -> None:
    """Benchmark records say which kernels ran: the loaded module's SIMD path and how
    it was chosen (an EMBER_KERNEL_ISA build is not a native one), or why none."""
    from types import SimpleNamespace

    monkeypatch.setattr(kernels, "_tried", True)
    for name, simd, label, flags in [
            ("ember_quant_matmul", "avx512vnni", "avx512vnni, -march=native", ["-march=native"]),
            ("ember_quant_matmul_generic", "scalar", "scalar, no -march", []),
            ("ember_quant_matmul_avx2", "avx2", "avx2, EMBER_KERNEL_ISA=avx2",
             SIMD_VARIANTS["avx2"]),
            ("ember_quant_matmul_avx2vnni", "avx2vnni", "avx2vnni, EMBER_KERNEL_ISA=avx2vnni",
             SIMD_VARIANTS["avx2vnni"])]:
        module = SimpleNamespace(__name__=name, simd=lambda s=simd: s)
        monkeypatch.setattr(kernels, "_module", module)
        assert (kernels.describe(), kernels.loaded_flags()) == (label, flags)
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_error", "disabled by EMBER_NO_KERNELS")
    assert kernels.describe() == "none (disabled by EMBER_NO_KERNELS)"
    assert kernels.loaded_flags() is None


def test_an_isa_build_the_cpu_cannot_run_is_refused_by_name(monkeypatch) -> None:
    """EMBER_KERNEL_ISA=avx2vnni on a CPU without AVX-VNNI would die of SIGILL at the first
    matmul; it is refused up front, naming the missing flag."""
    monkeypatch.setenv("EMBER_KERNEL_ISA", "avx2vnni")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512_vnni"})
    with pytest.raises(RuntimeError, match="EMBER_KERNEL_ISA=avx2vnni: this CPU lacks avx_vnni"):
        kernels._variants()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx_vnni"})
    assert kernels._variants() == (kernels._ISA_VARIANTS["avx2vnni"],)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["scalar", "avx2", "avx2vnni"])
def test_other_simd_builds_agree(ext, variant: str, tiny_q4_model) -> None:
    """The portable fallback, the plain-AVX2 path and the AVX2 + VNNI one pack every type
    to the same bytes and give the native build's results."""
    mod = build_variant(variant)
    assert mod.simd() == variant
    cols = 512
    torch.manual_seed(0)
    xs = [torch.randn(m, cols) for m in MS]
    for qtype in ALL_TYPES:
        raw = any_raw(qtype, 75, cols, 9)
        lin = QuantLinear.from_raw([(raw, qtype, (75, cols))])
        (t, rows, blob), = lin.packed.segments
        ours = torch.empty_like(blob)
        mod.pack_rows(ours, raw, t, 0, rows, cols)
        assert torch.equal(ours, blob), qtype
        other = mod.PackedLinear(cols, lin.packed.segments)
        assert torch.equal(other.dequantize(), lin.dequantize())
        for x in xs:
            for gm in (INT_PATH, GEMM_PATH):
                ref = lin.packed.matmul(x, gm)
                torch.testing.assert_close(other.matmul(x, gm), ref, rtol=1e-5,
                                           atol=1e-5 * ref.abs().amax().item())
    # MXFP4 scales below the normal range (each build decodes them its own way)
    raw = random_mxfp4_raw(16, cols, 3).reshape(-1, 17)
    raw[:, 0] &= 1
    lin = QuantLinear.from_raw([(raw.reshape(-1), GGMLType.MXFP4, (16, cols))])
    other = mod.PackedLinear(cols, lin.packed.segments)
    x = xs[1] * 1e30
    torch.testing.assert_close(other.matmul(x, INT_PATH), lin.packed.matmul(x, INT_PATH))
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
    ids = list(range(100, 140))
    native_logits = tiny.score(ids)
    variant_logits = score_with_stack(tiny, native_decoder(tiny.cfg, tiny.layers, ext=mod), ids)
    torch.testing.assert_close(variant_logits, native_logits, rtol=1e-3, atol=1e-3)
    x = xs[-1]
    qa, da, sa, ca, ia, la = mod.quantize_activations(x)
    qb, db, sb, cb, ib, lb = ext.quantize_activations(x)
    assert torch.equal(qa, qb) and torch.equal(da, db) and torch.equal(ia, ib)
    assert torch.equal(la, lb)
    # float block sums: only the order of 32 additions differs (c is a difference of them)
    xmax = x.abs().max().item()
    torch.testing.assert_close(sa, sb, rtol=0, atol=1e-5 * xmax)
    torch.testing.assert_close(ca, cb, rtol=0, atol=1e-5 * xmax)


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
    assert q4.model.output.types == [GGMLType.Q8_0]  # SmolLM2's tied Q8_0 head
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
