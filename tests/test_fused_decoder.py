"""The fused native decoder stack (q4) against the op-by-op f32 model, the oracle.

Per layer: each of SmolLM2's 30 layers, fed the f32 model's own hidden states, adds
to the residual stream what the f32 layer adds, within q4's quantization error.
End to end (teacher forcing on real text): KL and top-1 bounds that hold on AVX2-only
and AVX-512/VNNI machines alike. The scalar build of the same source gives the native
build's results (tests/test_quant_matmul.py builds it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from native import require_kernels

from ember.kv.blocks import KV_DTYPES, BlockAllocator, BlockTable
from ember.models.decoder import DecoderModel
from ember.models.layers.attention import AttentionBatch, RowSpec
from ember.models.loader import load_model


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    require_kernels()

TEXT = ("The lighthouse stood at the edge of the harbour for nearly two hundred years. Its "
        "keepers kept careful logs of every ship that passed, the direction of the wind, and "
        "the height of the tide each morning and evening. When the lamp was finally automated "
        "in the middle of the last century, the town council debated whether the old building "
        "should become a museum or be sold to a private owner.")


@pytest.fixture(scope="module")
def models(smollm2_gguf, smollm2_q4):
    return smollm2_q4, load_model(str(smollm2_gguf), "f32")


def one_layer(model: DecoderModel, i: int) -> DecoderModel:
    cfg = dataclasses.replace(model.cfg, n_layers=1)
    return DecoderModel(cfg, model.embed, model.layers[i:i + 1], model.output_norm, model.output,
                      None, model.norm)  # SmolLM2 has no rope_freqs


def layer_inputs(f32: DecoderModel, ids: list[int]):
    """The f32 model's residual stream entering each layer, and the step's metadata."""
    n, bs = len(ids), 16
    table = BlockTable(BlockAllocator(-(-n // bs)), bs)
    table.reserve(n)
    batch = AttentionBatch.build([RowSpec(table.block_ids(n), 0, n)], bs)
    x = f32.embed(torch.tensor(ids))
    inputs = []
    for i in range(f32.cfg.n_layers):
        inputs.append(x)
        layer = one_layer(f32, i)
        x = layer.decode_layers(x, batch, layer.new_kv_storage(-(-n // bs), bs))
    return inputs, batch


def test_each_fused_layer_adds_what_the_f32_layer_adds(models):
    q4, f32 = models[0].model, models[1].model
    ids = models[0].tokenizer.encode(TEXT)
    inputs, batch = layer_inputs(f32, ids)
    n = len(ids)
    for i, x in enumerate(inputs):
        fused, oracle = one_layer(q4, i), one_layer(f32, i)
        assert fused.native is not None and oracle.native is None
        kv = fused.new_kv_storage(-(-n // 16), 16)
        got = fused.decode_layers(x, batch, kv) - x
        want = oracle.decode_layers(x, batch, kv) - x
        rel = (got - want).norm() / want.norm()
        # q4's weight and int8-activation rounding: 0.5-1.5 % per layer measured
        assert rel < 0.04, (i, rel.item())


def test_fused_stack_end_to_end_against_f32(models):
    """Teacher-forced over real text: the q4 stack's next-token distributions."""
    q4, f32 = models[0].model, models[1].model
    ids = models[0].tokenizer.encode(TEXT * 2)
    assert q4.native is not None
    got, want = q4.score(ids), f32.score(ids)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert kl < 0.02 and top1 > 0.9, (kl, top1)


@pytest.mark.slow
def test_a_long_step_in_slices_of_tokens_is_the_same_bits_as_one_call(models, monkeypatch):
    """Two prompts of 700 and 520 tokens in one step: the stack run over 512-token
    slices (the default), over 100-token slices (cuts inside both rows), and in one
    call gives the same residual stream and the same K/V, bit for bit."""
    import ember.models.decoder as decoder

    q4 = models[0].model
    ids = models[0].tokenizer.encode(TEXT * 20)
    lengths, bs = (700, 520), 16
    assert len(ids) >= max(lengths)
    alloc = BlockAllocator(sum(-(-n // bs) for n in lengths))
    specs = []
    for n in lengths:
        table = BlockTable(alloc, bs)
        table.reserve(n)
        specs.append(RowSpec(table.block_ids(n), 0, n))
    batch = AttentionBatch.build(specs, bs)
    x = q4.embed(torch.tensor([t for n in lengths for t in ids[:n]]))

    def run(slice_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(decoder, "NATIVE_SLICE_TOKENS", slice_tokens)
        kv = q4.new_kv_storage(alloc.num_blocks, bs)
        kv.pool.zero_()  # the pool is not initialised: slots no token writes must match
        return q4.decode_layers(x, batch, kv), kv.pool

    whole_x, whole_kv = run(1 << 20)
    for slice_tokens in (512, 100):
        got_x, got_kv = run(slice_tokens)
        assert torch.equal(got_x, whole_x) and torch.equal(got_kv, whole_kv), slice_tokens


@pytest.mark.parametrize("kv_dtype", ["f16", "bf16", "q8_0"])
def test_narrow_pools_hold_the_rounded_or_quantized_kv(models, kv_dtype):
    """With an f16/bf16 pool the stack stores K/V rounded as torch rounds (to nearest
    even), with a q8_0 pool quantized to the bytes ember.kv.dtypes computes (tested
    against a numpy emulation of llama.cpp in tests/test_kv_dtypes.py), and attends over
    exactly those values: its KV equals the f32-pool run's KV stored in the narrower
    dtype, and its logits stay close."""
    q4 = models[0].model
    ids = models[0].tokenizer.encode(TEXT)
    n, bs = len(ids), 16
    outs, pools = [], []
    for dt in ("f32", kv_dtype):
        table = BlockTable(BlockAllocator(-(-n // bs)), bs)
        table.reserve(n)
        kv = q4.new_kv_storage(-(-n // bs), bs, dt)
        kv.zero_blocks(table.allocator.take_unzeroed())  # the last block's tail: zeros in both
        batch = AttentionBatch.build([RowSpec(table.block_ids(n), 0, n)], bs)
        outs.append(q4.forward(torch.tensor(ids), batch, kv, torch.arange(n)))
        pools.append(kv.pool[:, 0])  # layer 0's K and V of every position
    # layer 0's K/V do not depend on the pool dtype (later layers read rounded values)
    assert torch.equal(KV_DTYPES[kv_dtype].encode(pools[0]), pools[1])
    # rounded K/V: a small, nonzero change of the logits, position by position (measured
    # mean 0.04 for each dtype: q4's int8 activations turn any rounding into about this;
    # a single position's ranges from 0.02 to 0.15)
    rel = ((outs[1] - outs[0]).norm(dim=-1) / outs[0].norm(dim=-1)).mean().item()
    assert 0 < rel < 0.08, rel


def test_the_stack_refuses_a_mismatched_pool(models):
    q4 = models[0].model
    kv = q4.new_kv_storage(4, 16)
    bad = torch.zeros(4, 2, 2, 16, 3, 64)  # two layers, the model has 30
    table = BlockTable(BlockAllocator(4), 16)
    table.reserve(3)
    batch = AttentionBatch.build([RowSpec(table.block_ids(3), 0, 3)], 16)
    x = q4.embed(torch.tensor([1, 2, 3]))
    rope = torch.view_as_real(q4.rope.rotation(batch.positions)).contiguous()
    with pytest.raises(RuntimeError, match="KV pool shape"):
        q4.native.forward(x, bad, [rope], batch.slot_mapping, batch.tables, batch.token_rows,
                          batch.positions)
    with pytest.raises(RuntimeError, match="slot out of range"):
        q4.native.forward(x, kv.pool, [rope], batch.slot_mapping + 10_000, batch.tables,
                          batch.token_rows, batch.positions)


def test_batch_invariance_is_reported_where_it_holds(models):
    q4, f32 = models[0].model, models[1].model
    assert q4.batch_invariant and not f32.batch_invariant
    saved, q4.native = q4.native, None
    try:
        assert not q4.batch_invariant
    finally:
        q4.native = saved


def test_attention_batch_refuses_a_row_without_room():
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionBatch.build([RowSpec(torch.tensor([3, 4]), 0, 40),
                              RowSpec(torch.tensor([1, 2, 5]), 30, 3)], 16)


def test_the_stack_refuses_slots_that_do_not_match_the_table(models):
    q4 = models[0].model
    kv = q4.new_kv_storage(4, 16)
    table = BlockTable(BlockAllocator(4), 16)
    table.reserve(3)
    batch = AttentionBatch.build([RowSpec(table.block_ids(3), 0, 3)], 16)
    x = q4.embed(torch.tensor([1, 2, 3]))
    rope = torch.view_as_real(q4.rope.rotation(batch.positions)).contiguous()
    slots = batch.slot_mapping.clone()
    slots[1] = slots[2]  # two tokens into one slot, one position never written
    with pytest.raises(RuntimeError, match="slot does not match"):
        q4.native.forward(x, kv.pool, [rope], slots, batch.tables, batch.token_rows,
                          batch.positions)
    bad_pool = torch.zeros(4, 30, 1, 16, 3, 64)  # no V half
    with pytest.raises(RuntimeError, match="KV pool"):
        q4.native.forward(x, bad_pool, [rope], batch.slot_mapping, batch.tables,
                          batch.token_rows, batch.positions)
