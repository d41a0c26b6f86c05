"""Every family against transformers, on GGUFs llama.cpp's converter wrote.

Per family (``tests/hf_families.py``): a tiny transformers model with random weights,
converted by ``convert_hf_to_gguf.py``. ember must give transformers' logits on the
f32 file (float32 on both sides: observed max |Δlogit| ≤ 1e-5 with |logits| up to
~10; a dropped soft cap, NoPE layer, multiplier or misplaced norm costs ≥ 0.1) and
its greedy tokens; on the Q8_0 file the fused native stack must run each family (but
the hybrid ones) and agree with the op-by-op path on the same packed weights, and stay
batch-invariant.
A mixture-of-experts family (gpt-oss) also runs with its experts in MXFP4, against
llama.cpp on the same file.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_families import FAMILIES, ConvertedFamily, convert_families
from llamacpp_source import Converter
from native import fused_vs_op_by_op, require_kernels

from ember.models.loader import load_model
from ember.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

ATOL = 1e-4
IDS = list(range(5, 400, 7))  # 57 tokens: past Gemma 2's window of 6 several times
families = pytest.mark.parametrize("name", sorted(FAMILIES))
stack_families = pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items()
                                                        if f.native_stack))


@pytest.fixture(scope="module")
def converter() -> Iterator[Converter]:
    """llama.cpp's converter, for the tests that convert a checkpoint of their own."""
    started = Converter()
    yield started
    started.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path
              ) -> Iterator[dict[str, ConvertedFamily]]:
    """Every family converted (cached on disk across runs: ``hf_families``); llama.cpp's
    converter is started only when the cache misses."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    started: list[Converter] = []

    def converter() -> Converter:
        started.append(Converter())
        return started[0]

    root = tmp_path_factory.mktemp("families")
    try:
        yield convert_families(sorted(FAMILIES), root, smollm2_gguf, converter)
    finally:
        for c in started:
            c.close()


@pytest.fixture(scope="module")
def loaded_f32(converted: dict[str, ConvertedFamily]):
    return {name: load_model(str(c.f32), "f32") for name, c in converted.items()}


@families
def test_logits_match_transformers(converted, loaded_f32, name: str) -> None:
    ours = loaded_f32[name].model.score(IDS)
    with torch.no_grad():
        theirs = converted[name].hf(torch.tensor([IDS])).logits[0]
    err = (ours - theirs).abs().max().item()
    print(f"{name}: max |Δlogit| {err:.1e} (|logits| up to {theirs.abs().max():.1f})")
    assert err < FAMILIES[name].atol


@families
def test_greedy_continuation_matches_transformers(converted, name: str) -> None:
    import ember

    n, prompt = 24, IDS[:20]
    with torch.no_grad():
        out = converted[name].hf.generate(torch.tensor([prompt]), max_new_tokens=n,
                                          min_new_tokens=n, do_sample=False)
    llm = ember.LLM(str(converted[name].f32), weights="f32", num_kv_blocks=64)
    (ours,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                    ignore_eos=True))
    assert list(ours.token_ids) == out[0, len(prompt):].tolist()


@stack_families
def test_fused_native_stack_runs_the_family(converted, name: str) -> None:
    """The native stack against the PyTorch path on the same packed Q8_0 weights (both
    quantize activations to int8, so a last-bit difference may flip a code: observed
    ≤ 1e-2 relative; a missing family option costs far more)."""
    require_kernels()
    _, rel = fused_vs_op_by_op(load_model(str(converted[name].q8_0), "q4").model, IDS)
    print(f"{name}: fused vs op-by-op relative error {rel:.2e}")
    assert rel < 0.05, rel


@stack_families
def test_fused_native_stack_is_batch_invariant(converted, name: str) -> None:
    from test_batch_invariance import outcomes, params, random_prompts

    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    require_kernels()
    path = converted[name].q8_0
    q = load_model(str(path), "q4")
    vocab = q.config.vocab_size
    prompts = [[t % vocab for t in p] for p in random_prompts(4, seed=3, lo=1, hi=30)]
    sps = [params(i, max_tokens=8) for i in range(4)]

    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), weights="q4", num_kv_blocks=64),
                         loaded=q)

    alone = [outcomes(make(), [p], [sp])[0] for p, sp in zip(prompts, sps, strict=True)]
    assert outcomes(make(), prompts, sps) == alone


def test_hybrid_sequences_keep_their_own_recurrent_state(converted) -> None:
    """Qwen 3.5's linear-attention layers keep one state per sequence: prompts of
    different lengths run together — prefilled in chunks of 5 across steps, two at a
    time so a finished one's state slot is taken by a waiting one, and with so few KV
    blocks that a sequence is preempted and recomputed — each give transformers' own
    greedy tokens; every slot is given back."""
    import ember

    c = converted["qwen35"]
    prompts, n = [IDS[:20], IDS[3:9], IDS[10:41], IDS[:2]], 12
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = c.hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    llm = ember.LLM(str(c.f32), weights="f32", num_kv_blocks=6, block_size=8,
                    max_num_seqs=2, max_prefill_chunk=5)
    engine = llm.engine
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected
    assert engine.scheduler.num_preemptions > 0  # the recompute path was taken
    engine.kv.check_no_leaks()
    # n > 1: siblings do not share a state; each prefills its own and agrees
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    group = engine.add_group(prompts[0], [greedy, greedy])
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in group] == [expected[0]] * 2
    engine.kv.check_no_leaks()


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_native_hybrid_stack_is_chunk_and_preemption_invariant(converted, name: str) -> None:
    """The native stack carries each row's recurrent state across steps: prompts
    prefilled in chunks of 5, two rows at a time, with a preemption and a recompute,
    give bitwise the outcomes (tokens and logprobs) each gets alone in one chunk; the
    states are the op-by-op path's (teacher-forced logits within the q4 kernels'
    rounding), and the stack refuses a step without them."""
    from test_batch_invariance import outcomes, params

    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    require_kernels()
    path = converted[name].q8_0
    q = load_model(str(path), "q4")
    assert q.model.native is not None
    prompts = [IDS[:20], IDS[3:9], IDS[10:41], IDS[:2]]
    sps = [params(i, max_tokens=10) for i in range(4)]

    def make(**kw: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), weights="q4", **kw), loaded=q)

    # the same block size: attention's sums follow the pool's blocks
    alone = [outcomes(make(num_kv_blocks=64, block_size=8), [p], [sp])[0]
             for p, sp in zip(prompts, sps, strict=True)]
    tight = make(num_kv_blocks=6, block_size=8, max_num_seqs=2, max_prefill_chunk=5)
    assert outcomes(tight, prompts, sps) == alone
    assert tight.scheduler.num_preemptions > 0
    tight.kv.check_no_leaks()
    _, rel = fused_vs_op_by_op(q.model, IDS)
    assert rel < 0.05, rel
    x = torch.zeros(1, q.config.hidden_size)
    kv = q.model.new_kv_storage(4, 16)
    with pytest.raises(RuntimeError, match="conv_state, ssm_state and token_state"):
        q.model.native.forward(x, kv.pool, [torch.zeros(1, q.config.rope_dim)],
                               torch.zeros(1, dtype=torch.long),
                               torch.zeros(1, 4, dtype=torch.long),
                               torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_native_recurrent_state_is_the_same_bits_however_a_prompt_is_chunked(
        converted, name: str) -> None:
    """The states themselves (not only the outputs, which int8 activations round), and
    every logit: a prompt in one call, in chunks of 5, and token by token."""
    from ember.kv.blocks import BlockAllocator, BlockTable
    from ember.models.layers.attention import AttentionBatch, RowSpec

    require_kernels()
    model = load_model(str(converted[name].q8_0), "q4").model
    assert model.native is not None

    def run(chunk: int) -> tuple[torch.Tensor, ...]:
        table = BlockTable(BlockAllocator(8), 16)
        table.reserve(len(IDS))
        kv = model.new_kv_storage(8, 16, "f32")
        kv.zero_blocks(table.allocator.take_unzeroed())
        logits = []
        for a in range(0, len(IDS), chunk):
            n = min(chunk, len(IDS) - a)
            batch = AttentionBatch.build([RowSpec(table.block_ids(a + n), a, n, state=0)], 16)
            logits.append(model.forward(torch.tensor(IDS[a:a + n]), batch, kv,
                                        torch.arange(n)))
        return torch.cat(logits), kv.states.conv.clone(), kv.states.ssm.clone()

    whole = run(len(IDS))
    for chunk in (5, 1):
        assert all(torch.equal(x, y) for x, y in zip(run(chunk), whole, strict=True)), chunk


def _drain(engine: Any) -> list[Any]:
    """Step ``engine`` until it is idle: the finished outputs."""
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    return done


@pytest.mark.parametrize(("name", "weights"), [("qwen35", "q4"), ("qwen35moe", "q4"),
                                             ("qwen35", "f32")])
def test_hybrid_speculation_rewinds_the_state_and_commits_what_plain_decoding_does(
        converted, name: str, weights: str) -> None:
    """Drafts verified on a hybrid: a rejected draft token has entered the recurrent
    state, so the row's state goes back to its snapshot after the history and the
    accepted drafts run again next step. The committed streams (tokens and every
    logprob, greedy and seeded) equal speculation off; verifies with none, some and
    all of the draft accepted all happen; with a prefix cache of blocks of 4 (a verify
    row's snapshot is often the prefix cache's too) and in a batch."""
    from test_batch_invariance import outcomes, params

    from ember.config import EngineConfig
    from ember.engine.costs import Coefficients, StepCostModel
    from ember.engine.engine import LLMEngine

    path = converted[name].q8_0 if weights == "q4" else converted[name].f32
    loaded = load_model(str(path), weights)
    if weights == "q4":
        require_kernels()
        assert loaded.model.native is not None
    prompts = [IDS[:12], IDS[20:30], IDS[:5]]
    sps = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
           params(1, max_tokens=24), params(2, max_tokens=24)]
    verifies: list[tuple[int, int]] = []

    def run(speculation: str, references: tuple[str, ...] = ()) -> list[Any]:
        engine = LLMEngine(EngineConfig(model=str(path), weights=weights, num_kv_blocks=96,
                                        block_size=4, speculation=speculation,
                                        spec_references=references), loaded=loaded)
        # every draft priced to pay: as many verifies as the drafts allow, on any machine
        engine.scheduler.costs = StepCostModel(Coefficients(0.01, 1e-5, 0.0, 0.0, 0.0),
                                               learn=False)
        sampled = engine.commit.sampled

        def counted(row: Any, results: Any, *rest: Any) -> list[int]:
            committed = sampled(row, results, *rest)
            if row.draft:
                verifies.append((len(committed), len(row.draft)))
            return committed

        engine.commit.sampled = counted  # type: ignore[method-assign]
        got = outcomes(engine, prompts, sps)
        engine.purge_cache(None)
        engine.kv.check_no_leaks()
        return got

    plain = run("off")
    # a random model copies nothing: drafts come from texts of the streams plain decoding
    # commits; in the first 24 tokens, wrong ones put after two of every 7 (x2 J x3 J x4):
    # a draft runs into the first J, the next starts with the second
    vocab = loaded.config.vocab_size

    def reference(tokens: list[int]) -> str:
        out: list[int] = []
        for i, t in enumerate(tokens):
            out += [t, (t + 1) % vocab] if i % 7 in (2, 3) and i < 24 else [t]
        return loaded.tokenizer.decode(out)

    references = tuple(reference([*p, *out]) for p, (out, _) in zip(prompts, plain,
                                                                      strict=True))
    drafted = run("auto", references)
    if weights == "q4":  # the native stack is batch- and chunk-invariant: the same bits
        assert drafted == plain
    else:  # op by op, a verify row's matmul shapes round the last bits differently
        for (tokens, lps), (want, want_lps) in zip(drafted, plain, strict=True):
            assert tokens == want
            got = torch.tensor([lp for _, lp, _ in lps])
            assert torch.allclose(got, torch.tensor([lp for _, lp, _ in want_lps]), atol=1e-4)
    assert any(c == 1 for c, _ in verifies), verifies  # all rejected: restore only
    assert any(1 < c <= d for c, d in verifies), verifies  # some accepted: replayed
    assert any(c == d + 1 for c, d in verifies), verifies  # all accepted: no rewind


@pytest.mark.parametrize(("name", "weights"), [("qwen35", "q4"), ("qwen35moe", "q4"),
                                             ("qwen35", "f32")])
def test_a_hybrid_follow_up_turn_restores_a_state_snapshot(converted, name: str,
                                                           weights: str) -> None:
    """A chat's second turn (the first turn's prompt and answer, then more) finds the
    first turn's blocks and the recurrent-state snapshot taken at its last boundary,
    computes only the rest, and answers as a cold engine does: bitwise (tokens and
    logprobs) on the native stack, the same tokens op by op in f32. With room for one
    snapshot, turns of two conversations evict each other and stay correct."""
    from test_batch_invariance import outcomes, params

    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    if weights == "q4":
        require_kernels()
    path = converted[name].q8_0 if weights == "q4" else converted[name].f32
    q = load_model(str(path), weights)
    per_state = q.config.state_bytes_per_sequence

    def make(**kw: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), weights=weights, num_kv_blocks=64,
                                      block_size=8, **kw), loaded=q)

    warm = make()
    first = [IDS[:30], IDS[20:47]]
    answers = [o[0] for o in outcomes(warm, first, [params(i, 12) for i in range(2)])]
    follow = [p + list(a) + IDS[50:55] for p, a in zip(first, answers, strict=True)]
    sps = [params(10 + i, 10) for i in range(2)]
    cold = [outcomes(make(enable_prefix_caching=False), [p], [sp])[0]
            for p, sp in zip(follow, sps, strict=True)]
    # what a router is told: only as far as a snapshot reaches (the blocks reach 40 and
    # 40)
    assert [warm.cached_tokens(f) for f in follow] == [40, 32]
    # blocks reach 32 here, but the answer's snapshot at 32 gave way to the one at 40
    assert warm.cached_tokens(first[0] + list(answers[0][:3]) + [5, 6, 7, 8, 9]) == 24
    reqs = [warm.add_request(p, sp) for p, sp in zip(follow, sps, strict=True)]
    done = {o.request_id: o for o in _drain(warm)}
    # the last boundary the first turn computed past (its last token is not): 30 + 12 - 1
    # positions → 40; 27 + 12 - 1 → 32 (the follow-up's own 5 blocks reach 40)
    for req, (tokens, lps), hit in zip(reqs, cold, (40, 32), strict=True):
        assert req.cached_tokens == hit, req.cached_tokens
        assert done[req.request_id].token_ids == tokens
        if weights == "q4":
            assert [(lp.token, lp.logprob, lp.top) for lp in done[req.request_id].logprobs] \
                == lps
    # a branch off the first prompt (another user turn instead of the answer) reaches
    # the snapshot its prefill took: 30 tokens → the boundary at 24
    branch, sp = first[0] + IDS[60:66], params(20, 6)
    (want,) = outcomes(make(enable_prefix_caching=False), [branch], [sp])
    req = warm.add_request(branch, sp)
    (got,) = [o for o in _drain(warm) if o.request_id == req.request_id]
    assert req.cached_tokens == 24 and got.token_ids == want[0]
    warm.kv.check_no_leaks()
    # a tenant's purge takes its snapshots with its blocks
    assert warm.kv.snapshots is not None and len(warm.kv.snapshots)
    warm.purge_cache(None)
    assert len(warm.kv.snapshots) == 0 and warm.cached_tokens(follow[0]) == 0
    warm.kv.check_no_leaks()
    # one snapshot's room: each conversation's turns evict the other's
    tight = make(state_snapshot_bytes=per_state)
    assert tight.kv.snapshots is not None and tight.kv.snapshots.capacity == 1
    assert outcomes(tight, first, [params(i, 12) for i in range(2)])[0][0] == answers[0]
    for p, sp, want in zip(follow, sps, cold, strict=True):
        assert outcomes(tight, [p], [sp])[0][0] == want[0]
    tight.kv.check_no_leaks()
    # no room for one: no prefix reuse at all
    for room in (0, per_state - 1):
        none = make(state_snapshot_bytes=room)
        assert not none.config.enable_prefix_caching and none.kv.snapshots is None


def test_a_snapshot_past_the_stacks_first_slice_of_a_long_step(converted) -> None:
    """The native stack runs a step in slices of NATIVE_SLICE_TOKENS: a snapshot asked
    for by a token of a later slice is taken there (two 300-token prompts in one step,
    the second's boundary at flat token 587), and serves its follow-up as a cold engine
    would."""
    from test_batch_invariance import outcomes, params

    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.models.decoder import NATIVE_SLICE_TOKENS

    require_kernels()
    path = converted["qwen35"].q8_0
    q = load_model(str(path), "q4")
    prompts = [[(7 * i + 5 * j) % 4000 + 5 for i in range(300)] for j in range(2)]
    assert sum(map(len, prompts)) > NATIVE_SLICE_TOKENS

    def make(**kw: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), weights="q4", num_kv_blocks=96,
                                      max_num_batched_tokens=1024, max_prefill_chunk=512,
                                      max_prefill_step_seconds=1e3,
                                      **kw), loaded=q)

    warm = make()
    outcomes(warm, prompts, [params(i, 1) for i in range(2)])
    assert warm.steps == 1  # both prompts in one step of 600 tokens
    follow = [p + [11, 12, 13] for p in prompts]
    sps = [params(5 + i, 4) for i in range(2)]
    cold = [outcomes(make(enable_prefix_caching=False), [f], [sp])[0]
            for f, sp in zip(follow, sps, strict=True)]
    reqs = [warm.add_request(f, sp) for f, sp in zip(follow, sps, strict=True)]
    done = {o.request_id: o for o in _drain(warm)}
    for req, want in zip(reqs, cold, strict=True):
        assert req.cached_tokens == 288  # (300 - 1) // 16 * 16
        got = done[req.request_id]
        assert (got.token_ids, [(lp.token, lp.logprob, lp.top) for lp in got.logprobs]) == want
    warm.kv.check_no_leaks()


def test_a_hybrid_follow_up_after_a_restart_restores_blocks_and_snapshot_from_disk(
        converted, tmp_path: Path) -> None:
    """With the disk tier, a request's blocks and the state snapshots it filed go to disk
    when it ends; a new engine on the same directory (a restart) answers the chat's next
    turn from them — the same prefix as in RAM, bitwise what a cold engine answers. A
    snapshot file that fails its checksum is deleted and that turn recomputed (still
    right); a tenant's disk purge takes its snapshots."""
    from test_batch_invariance import outcomes, params

    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.kv.disk import SUFFIX
    from ember.kv.tier import state_key

    require_kernels()
    path = converted["qwen35"].q8_0
    q = load_model(str(path), "q4")

    def make(**kw: Any) -> LLMEngine:
        kw.setdefault("kv_cache_dir", str(tmp_path))
        return LLMEngine(EngineConfig(model=str(path), weights="q4", num_kv_blocks=64,
                                      block_size=8, kv_restore="always", **kw), loaded=q)

    first = [IDS[:30], IDS[20:47]]
    before = make()
    answers = [o[0] for o in outcomes(before, first, [params(i, 12) for i in range(2)])]
    before.close()
    follow = [p + list(a) + IDS[50:55] for p, a in zip(first, answers, strict=True)]
    sps = [params(10 + i, 10) for i in range(2)]
    cold = [outcomes(make(enable_prefix_caching=False, kv_cache_dir=None), [p], [sp])[0]
            for p, sp in zip(follow, sps, strict=True)]
    after = make()
    assert after.kv.snapshots is not None and len(after.kv.snapshots) == 0  # RAM is empty
    reqs = [after.add_request(p, sp) for p, sp in zip(follow, sps, strict=True)]
    done = {o.request_id: o for o in _drain(after)}
    for req, (tokens, lps), hit in zip(reqs, cold, (40, 32), strict=True):
        assert req.cached_tokens == hit, req.cached_tokens  # as the RAM test's
        got = done[req.request_id]
        assert got.token_ids == tokens
        assert [(lp.token, lp.logprob, lp.top) for lp in got.logprobs] == lps
    assert after.kv.tier is not None and after.kv.tier.restored_snapshots == 2
    after.close()
    # a snapshot file corrupted on disk: not served, the turn recomputed
    keys: list[bytes] = []
    salt = make().intake.salt_for(None, None)
    from ember.kv.prefix import extend_keys

    extend_keys(keys, salt, follow[0], 8)
    snapshot_file = next(tmp_path.rglob(state_key(keys[4]).hex() + SUFFIX))
    data = bytearray(snapshot_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot_file.write_bytes(bytes(data))
    again = make()
    req = again.add_request(follow[0], sps[0])
    (got,) = [o for o in _drain(again) if o.request_id == req.request_id]
    assert got.token_ids == cold[0][0] and req.cached_tokens < 40
    assert not snapshot_file.exists()
    # the tenant's disk purge deletes its snapshot files with its blocks
    again.purge_cache(None)
    again.purge_disk(None)
    again.close()
    assert not any(tmp_path.rglob("*" + SUFFIX))


def test_a_hybrid_prefix_travels_with_its_state_snapshot(converted, tmp_path: Path) -> None:
    """Exported (a conversation file, a handoff), a hybrid's cached prefix is its blocks
    up to the last one with a state snapshot, then that snapshot. A file kept over two
    turns holds both turns' snapshots; a fresh engine importing it restores the furthest
    its blocks reach and answers the next turn bitwise as a cold engine. Blocks without
    a state, or for another tenant, give nothing (and leak nothing)."""
    from test_batch_invariance import outcomes, params

    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.kv import conversation
    from ember.kv.tier import blocks_of, is_state

    require_kernels()
    path = converted["qwen35"].q8_0
    q = load_model(str(path), "q4")

    def make(**kw: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), weights="q4", num_kv_blocks=64,
                                      block_size=8, **kw), loaded=q)

    warm, file = make(), tmp_path / "chat.ember"
    fp = warm.kv_fingerprint()
    first = IDS[:30]
    ((a1, _),) = outcomes(warm, [first], [params(0, 12)])
    follow = first + list(a1) + IDS[50:55]  # 47 tokens; the answer's snapshot is at 40
    records = warm.export_prefix(follow)
    assert [is_state(r) for r in records] == [False] * 5 + [True]
    one = conversation.save_turn(file, fp, conversation.Conversation(), [], records)
    ((a2, _),) = outcomes(warm, [follow], [params(1, 10)])
    follow2 = follow + list(a2) + IDS[40:43]  # 60 tokens; the snapshot at 56
    two = conversation.save_turn(file, fp, one, [], warm.export_prefix(follow2))
    assert [is_state(r) for r in two.records] == [False] * 5 + [True] + [False] * 2 + [True]
    read = conversation.read(file, fp).records
    assert read == two.records and two.num_tokens == 56
    chain = blocks_of(read)
    sp = params(20, 8)
    for records, prompt, reach in ((read, follow2, 56),
                                   ([*chain[:6], *(r for r in read if is_state(r))], follow2, 40),
                                   (one.records, follow, 40)):
        (want,) = outcomes(make(enable_prefix_caching=False), [prompt], [sp])
        fresh = make()
        assert fresh.import_prefix(records) == reach
        req = fresh.add_request(prompt, sp)
        (got,) = _drain(fresh)
        assert req.cached_tokens == reach
        assert (got.token_ids, [(lp.token, lp.logprob, lp.top) for lp in got.logprobs]) == want
        fresh.kv.check_no_leaks()
    fresh = make()
    assert fresh.import_prefix(chain) == 0  # blocks whose state is missing are of no use
    assert fresh.import_prefix(read, tenant="someone else") == 0
    assert fresh.cached_tokens(follow2) == 0
    fresh.kv.check_no_leaks()


def test_a_hybrid_prompt_prefilled_on_one_replica_decodes_on_another(converted) -> None:
    """Disaggregated prefill for a hybrid: the handoff carries the prompt's blocks and
    the state snapshot after the last, and the decoding replica answers bitwise as one
    that computed everything itself."""
    import asyncio

    from test_batch_invariance import outcomes, params

    from ember.cluster import wire
    from ember.cluster.protocol import GroupSpec, Handoff, Verdict
    from ember.cluster.replica import EmberReplica
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.output import RequestOutput

    require_kernels()
    path = converted["qwen35"].q8_0
    q = load_model(str(path), "q4")
    config = EngineConfig(model=str(path), weights="q4", num_kv_blocks=64, block_size=8)
    prompt, sp = IDS[:47], params(3, 8)
    (want,) = outcomes(LLMEngine(config, loaded=q), [prompt], [sp])
    prefill, decode = EmberReplica(config, q), EmberReplica(config, q)

    def run(replica: EmberReplica, spec: GroupSpec) -> list:
        async def collect() -> list:
            return [wire.read_item(item)
                    async for item in replica.generate(*wire.call_args(spec))]

        return asyncio.run(collect())

    try:
        verdict, handoff = run(prefill, GroupSpec("p", prompt, [sp], "t", prefill=True))
        assert isinstance(verdict, Verdict) and verdict.error is None
        # the prefill computes 46 tokens: its last snapshot a lookup can reach is at 40
        assert isinstance(handoff, Handoff) and handoff.tokens == 40 and not handoff.error
        items = run(decode, GroupSpec("d", prompt, [sp], "t", handoff=handoff))
        assert items[0].imported["tokens"] == items[0].imported["loaded"] == 40
        last = [i for i in items if isinstance(i, RequestOutput)][-1]
        assert last.cached_tokens == 40
        assert (last.token_ids, [(lp.token, lp.logprob, lp.top) for lp in last.logprobs]) \
            == want
    finally:
        for replica in (prefill, decode):
            replica.thread.shutdown(timeout=5)


@pytest.mark.parametrize(("name", "change", "named"), [
    ("granite", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                     "original_max_position_embeddings": 128}}, "'yarn'"),
    ("olmo2", {"sliding_window": 8}, "sliding-window"),
])
def test_what_a_family_does_not_implement_is_refused_at_load(
        converted, converter: Converter, tmp_path: Path, name: str, change: dict,
        named: str) -> None:
    """A checkpoint the converter writes with a feature ember lacks for that family
    (YaRN where it is not implemented, OLMo 3's sliding windows) is refused by name when
    loaded, never run with a plain table."""
    import json
    import shutil

    from ember.errors import UnsupportedModelError

    checkpoint = tmp_path / "hf"
    shutil.copytree(converted[name].f32.parent / f"{name}-hf", checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **change}))
    (path,) = converter.convert([(checkpoint, tmp_path / "changed.gguf", ())])
    with pytest.raises(UnsupportedModelError, match=named):
        load_model(str(path), "f32")


LLAMA_PYTHON = os.environ.get("EMBER_LLAMA_PYTHON")


@pytest.mark.skipif(not LLAMA_PYTHON, reason="set EMBER_LLAMA_PYTHON to an interpreter "
                    "with llama-cpp-python to compare with llama.cpp")
@families
def test_logits_match_llama_cpp(converted, loaded_f32, tmp_path: Path, name: str) -> None:
    """llama.cpp on the same f32 file: the two implementations read the converter's
    output the same way. Observed max |Δlogit| ≤ 1.4e-5, except 2.1e-3 for Gemma 2:
    ggml's CPU GELU reads an f16 lookup table (ember computes it in f32, as
    transformers does, 4e-6 away); and Qwen 3.5 MoE, where a router near-tie at one
    position (49) puts llama.cpp 2.0e-3 from transformers (ember: 3.1e-4 from
    transformers, 1.7e-3 from llama.cpp there, ~1e-5 elsewhere). So ember may be as far
    from llama.cpp as transformers is (the two references bound each other), never
    further; the top token agrees at every position."""
    theirs = _llama_cpp_logits(converted[name].f32, tmp_path)
    ours = loaded_f32[name].model.score(IDS)
    with torch.no_grad():
        reference = converted[name].hf(torch.tensor([IDS])).logits[0]
    apart = (theirs - reference).abs().max().item()  # llama.cpp vs transformers
    err = (ours - theirs).abs().max().item()
    print(f"{name}: max |Δlogit| vs llama.cpp {err:.1e} (transformers: {apart:.1e})")
    assert err < (1e-2 if loaded_f32[name].config.activation == "gelu_tanh"
                  else max(FAMILIES[name].atol, 1.25 * apart))
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def _llama_cpp_logits(path: Path, tmp_path: Path) -> torch.Tensor:
    import numpy as np

    out = tmp_path / "logits.npy"
    subprocess.run([str(LLAMA_PYTHON), str(Path(__file__).with_name("llamacpp_logits.py")),
                    str(path), str(out), ",".join(map(str, IDS))], check=True)
    return torch.from_numpy(np.load(out))


def _q8_0_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as ggml's CPU feeds it to an MXFP4 (or Q8_0) matmul: per 32, d = max|x| / 127
    stored as f16, codes round(x / d)."""
    xb = x.reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d.half().float()).reshape(x.shape)


@pytest.mark.skipif(not LLAMA_PYTHON, reason="set EMBER_LLAMA_PYTHON to an interpreter "
                    "with llama-cpp-python to compare with llama.cpp")
def test_mxfp4_experts_match_llama_cpp(converted, tmp_path: Path) -> None:
    """gpt-oss with its experts in MXFP4, as released. ember dequantizes them exactly
    (tests/test_quant.py) and multiplies in f32; ggml multiplies by activations rounded
    to Q8_0. With that rounding put in front of ember's expert matmuls the two agree to
    5e-6 (without it: 0.08, all of it the rounding; a misread nibble, exponent or bias
    costs far more)."""
    from ember.models.linear import DenseLinear

    path = converted["gpt-oss"].mxfp4
    model = load_model(str(path), "f32").model
    assert model.experts is not None
    for layer in model.experts.experts:
        for expert in layer:
            for name in ("gate_up", "down"):
                linear = getattr(expert, name)
                assert isinstance(linear, DenseLinear)
                setattr(expert, name, lambda x, f=linear: f(_q8_0_rounded(x)))
    ours = model.score(IDS)
    theirs = _llama_cpp_logits(path, tmp_path)
    err = (ours - theirs).abs().max().item()
    print(f"gpt-oss MXFP4: max |Δlogit| vs llama.cpp {err:.1e}")
    assert err < ATOL


@pytest.mark.skipif(not LLAMA_PYTHON, reason="set EMBER_LLAMA_PYTHON to an interpreter "
                    "with llama-cpp-python to compare with llama.cpp")
def test_packed_mxfp4_experts_match_llama_cpp(converted, tmp_path: Path) -> None:
    """Under q4 the MXFP4 experts stay packed and run the native kernel with int8
    activations per 32, as ggml's MXFP4 x Q8_0 does; ggml keeps the activations' scale in
    f16 and ember in f32, and this random network amplifies such rounding (observed
    0.06, as ember's f32 path is 0.08 from llama.cpp here); the kernel's own arithmetic
    is checked exactly in tests/test_quant_matmul.py."""
    from ember.models.linear import QuantLinear

    require_kernels()
    path = converted["gpt-oss"].mxfp4
    model = load_model(str(path), "q4").model
    assert model.experts is not None
    assert all(isinstance(x.gate_up, QuantLinear) for x in model.experts.experts[0])
    ours = model.score(IDS)
    theirs = _llama_cpp_logits(path, tmp_path)
    err = (ours - theirs).abs().max().item()
    print(f"gpt-oss MXFP4 (q4, packed): max |Δlogit| vs llama.cpp {err:.1e}")
    assert err < 0.15
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9  # near-ties aside


def test_mxfp4_experts_match_transformers_on_the_same_weights(converted) -> None:
    """The MXFP4-expert file against transformers holding gguf-py's dequantization of
    the same experts (gate and up interleaved into its gate_up_proj, as the converter
    reads them): the format read as gguf-py reads it, everything else as before."""
    import copy

    import gguf as gguf_py

    from ember.models.gguf import GGUFFile

    path = converted["gpt-oss"].mxfp4
    hf = copy.deepcopy(converted["gpt-oss"].hf)
    with GGUFFile(path) as g:
        def experts(name: str) -> torch.Tensor:
            info = g.tensor(name)
            assert info.type_name == "MXFP4"
            raw = g.tensor_bytes(name).reshape(info.shape[0] * info.shape[1], -1)
            flat = gguf_py.quants.dequantize(raw, gguf_py.GGMLQuantizationType.MXFP4)
            return torch.from_numpy(flat.copy()).reshape(info.shape)  # [E, out, in]

        with torch.no_grad():
            for i, layer in enumerate(hf.model.layers):
                gate, up = (experts(f"blk.{i}.ffn_{x}_exps.weight") for x in ("gate", "up"))
                gate_up = layer.mlp.experts.gate_up_proj
                gate_up[:, :, ::2] = gate.transpose(1, 2)
                gate_up[:, :, 1::2] = up.transpose(1, 2)
                layer.mlp.experts.down_proj.copy_(
                    experts(f"blk.{i}.ffn_down_exps.weight").transpose(1, 2))
            theirs = hf(torch.tensor([IDS])).logits[0]
            before = converted["gpt-oss"].hf(torch.tensor([IDS])).logits[0]
    ours = load_model(str(path), "f32").model.score(IDS)
    err = (ours - theirs).abs().max().item()
    print(f"gpt-oss MXFP4: max |Δlogit| vs transformers {err:.1e} (the quantization "
          f"itself moved them {(theirs - before).abs().max():.1e})")
    assert err < ATOL


def test_an_mlp_without_its_gate_is_refused_naming_the_tensor(converted, tmp_path: Path
                                                               ) -> None:
    from hf_gguf import rewrite_gguf

    from ember.errors import UnsupportedModelError

    path = rewrite_gguf(converted["smollm3"].f32, tmp_path / "no-gate.gguf",
                        drop_tensors=("blk.1.ffn_gate.weight",))
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_gate\.weight"):
        load_model(str(path), "f32")


def test_a_mistral3_mixture_of_experts_is_refused_naming_the_key(converted, tmp_path: Path
                                                                ) -> None:
    """Mistral 3's MoE variant (expert tensors, multi-head latent attention in Mistral 4)
    is not implemented: its expert count is named, nothing runs as a dense model."""
    from hf_gguf import rewrite_gguf

    from ember.errors import UnsupportedModelError

    path = rewrite_gguf(converted["mistral3"].f32, tmp_path / "moe.gguf",
                        add_keys={"mistral3.expert_count": 8})
    with pytest.raises(UnsupportedModelError, match=r"mistral3\.expert_count"):
        load_model(str(path), "f32")


def test_a_missing_or_misshapen_tensor_is_refused_naming_it(converted, tmp_path: Path
                                                            ) -> None:
    """An inconsistent file (a tensor gone, as a broken converter leaves it) fails at
    load with an error naming the tensor, before any request."""
    from hf_gguf import rewrite_gguf

    from ember.errors import EmberError

    path = rewrite_gguf(converted["granite"].f32, tmp_path / "no-k.gguf",
                        drop_tensors=("blk.1.attn_k.weight",))
    with pytest.raises(EmberError, match=r"blk\.1\.attn_k\.weight"):
        load_model(str(path), "f32")
