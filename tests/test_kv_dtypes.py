"""The KV pool's dtypes (ember.kv.dtypes): q8_0 against an independent numpy emulation
of llama.cpp's x86 quantizer, and the pool (KVStorage) holding q8_0 rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.kv.blocks import KVStorage
from ember.kv.dtypes import KV_DTYPES, dequantize_q8_0, kv_dtype, quantize_q8_0

Q8 = KV_DTYPES["q8_0"]


def numpy_q8_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q8_0 (x86 path) in numpy float32, one block per row of
    (blocks, 32): amax, d = amax / 127, codes rint(x * (127 / amax)) (rint: ties to
    even), d to f16; a block is d's two little-endian bytes, then the codes."""
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(b * inv[:, None]).astype(np.int8)
    scale = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    return np.concatenate([scale, codes.view(np.uint8)], axis=1).reshape(
        *x.shape[:-1], x.shape[-1] // 32 * 34)


def test_q8_0_codes_and_scales_equal_the_numpy_emulation_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, 8, 64, generator=g) * s for s in (1e-6, 3e-3, 1.0, 40.0, 9e3)]
    heavy = torch.randn(64, 8, 64, generator=g) ** 5  # heavy tails: one value dominates
    zeros = torch.zeros(2, 3, 32)
    zeros[1, 1, 7] = -0.25  # one nonzero value in an otherwise empty block
    for x in [*rows, heavy, zeros]:
        got = quantize_q8_0(x)
        assert got.dtype == torch.uint8 and got.shape == (*x.shape[:-1], x.shape[-1] // 32 * 34)
        want = numpy_q8_0(x.numpy())
        assert np.array_equal(got.numpy(), want)
    # the scale and codes are where llama.cpp's block_q8_0 keeps them
    block = quantize_q8_0(torch.tensor([[-254.0] + [0.0] * 31]))[0]
    assert block[:2].view(torch.float16).item() == 2.0 and block[2:].view(torch.int8)[0] == -127


def test_q8_0_rounds_ties_to_even():
    # amax 127: d = 1 and 127 / amax = 1, so x * (127 / amax) is x exactly
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5] + [0.0] * 23)
    codes = quantize_q8_0(x)[2:].view(torch.int8)
    assert codes[:9].tolist() == [127, 0, 2, 2, 0, -2, -2, 4, 126]
    assert np.array_equal(quantize_q8_0(x).numpy(), numpy_q8_0(x.numpy()))


def test_q8_0_multiplies_by_127_over_amax_rounded_once():
    """Codes are x * (127 / amax) with the quotient correctly rounded, as the native
    K/V write computes them — not 127 * (1 / amax), which is what torch computes for
    ``scalar / tensor``: blocks whose codes the two roundings set apart."""
    rng = np.random.default_rng(3)
    amax = rng.uniform(0.5, 2, 400).astype(np.float32)
    inv = np.float32(127) / amax
    other = (np.float32(1) / amax) * np.float32(127)
    # values at a code's rounding boundary under one quotient, and a step either side
    k = np.arange(127, dtype=np.float32)
    mid = ((k[None] + np.float32(0.5)) / inv[:, None]).astype(np.float32)
    blocks = []
    for x in (mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))):
        rows, cols = np.nonzero(np.rint(x * inv[:, None]) != np.rint(x * other[:, None]))
        blocks += [[amax[r], x[r, c]] + [0.0] * 30 for r, c in zip(rows, cols, strict=True)]
    assert len(blocks) > 100
    x = torch.tensor(np.array(blocks, np.float32))
    assert np.array_equal(quantize_q8_0(x).numpy(), numpy_q8_0(x.numpy()))


def test_q8_0_reads_back_exactly_code_times_scale():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, 96, generator=g)
    stored = quantize_q8_0(x)
    blocks = stored.view(16, 4, 3, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).double()
    codes = blocks[..., 2:].view(torch.int8).double()
    want = (codes * d).reshape(16, 4, 96)  # exact in double, and so in float32
    got = dequantize_q8_0(stored)
    assert got.dtype == torch.float32 and torch.equal(got.double(), want)
    amax = x.view(16, 4, 3, 32).abs().amax(-1, keepdim=True)
    err = (got - x).view(16, 4, 3, 32).abs()
    # half a step, plus d's rounding to f16 (2^-11 relative) times a code of up to 127
    assert bool((err <= amax / 127 * (0.5 + 127 * 2.0**-11) * 1.001).all())


def test_q8_0_refuses_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError, match="32"):
        quantize_q8_0(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="q8_0.*head_dim 48"):
        KVStorage(1, 4, 16, 2, 48, "q8_0")


def test_kv_dtype_names_and_storage_types_name_one_format():
    assert kv_dtype("q8_0") is Q8 and kv_dtype(torch.uint8) is Q8
    assert kv_dtype(torch.float16) is KV_DTYPES["f16"] and kv_dtype(Q8) is Q8
    with pytest.raises(ValueError, match="f8"):
        kv_dtype("f8")


def test_a_q8_0_pool_stores_blocks_of_34_bytes_per_32_values():
    layers, blocks, bs, heads, dim = 3, 6, 4, 2, 64
    kv = KVStorage(layers, blocks, bs, heads, dim, "q8_0")
    assert kv.pool.dtype == torch.uint8 and kv.pool.shape == (blocks, layers, 2, bs, heads, 68)
    f16 = KVStorage.bytes_per_block_of(layers, bs, heads, dim, "f16")
    q8 = KVStorage.bytes_per_block_of(layers, bs, heads, dim, "q8_0")
    assert kv.bytes_per_block == q8 == 2 * layers * bs * heads * dim // 32 * 34
    assert q8 / f16 == 34 / 64
    kv.zero_blocks(list(range(blocks)))
    assert torch.equal(Q8.decode(kv.k[1]), torch.zeros(blocks, bs, heads, dim))
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(5, heads, dim, generator=g), torch.randn(5, heads, dim, generator=g)
    where = (torch.tensor([2, 2, 5, 0, 3]), torch.tensor([0, 3, 1, 2, 3]))
    kv.write(1, *where, k, v)
    assert torch.equal(kv.k[1][where], quantize_q8_0(k))
    assert torch.equal(kv.v[1][where], quantize_q8_0(v))
    assert torch.equal(Q8.decode(kv.v[1][where]), dequantize_q8_0(quantize_q8_0(v)))
    kv.copy_block(2, 4)
    assert torch.equal(kv.pool[4], kv.pool[2])
    data = kv.block_bytes(5)
    assert len(data) == q8
    kv.load_block(0, data)
    assert torch.equal(kv.pool[0], kv.pool[5])
