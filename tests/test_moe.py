"""Mixture of experts (Qwen3-MoE): the resident path against transformers, the fused
native stack's routed experts against the op-by-op path, and experts streamed from
disk against the resident path, on random-weight GGUFs written here.

transformers reads the same file (its GGUF reader and Qwen3-MoE code; it maps neither
the experts' FFN size nor Qwen3's renormalised top-k from the GGUF, so both are
passed): float32 logits agree to 4e-6 (|logits| ~5), ``ATOL`` leaves 25x headroom.
Streaming changes where an expert's bytes come from, never the arithmetic, so
streamed and resident runs must agree to the bit at every cache budget, with the
pilot guessing or not.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_gguf import transformers_from_gguf
from native import fused_vs_op_by_op, require_kernels

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.loader import load_model
from ember.models.moe import (
    HISTOGRAM_SUFFIX,
    PINNED_SHARE,
    READ_AHEAD,
    ExpertReadError,
    MoEOptions,
)
from ember.sampling.params import SamplingParams

ATOL = 1e-4
N_LAYERS, N_EXPERTS, N_USED = 3, 8, 2
IDS = list(range(5, 300, 5))
PROMPTS = [list(range(10, 60)), list(range(300, 320)), [7] * 5 + list(range(900, 940))]


@pytest.fixture(scope="module")
def moe_gguf(tiny_moe_gguf: Path) -> Path:
    return tiny_moe_gguf  # N_LAYERS, N_EXPERTS, N_USED and a 128-wide expert FFN


@pytest.fixture
def model_copy(moe_gguf: Path, tmp_path: Path) -> Path:
    """A private copy: its expert histogram and any damage stay in this test."""
    path = tmp_path / moe_gguf.name
    shutil.copy(moe_gguf, path)
    return path


@pytest.fixture(scope="module")
def resident(moe_gguf: Path):
    return load_model(str(moe_gguf), "f32")


def expert_bytes(loaded) -> int:
    """Resident bytes of one built expert (all experts are one size here)."""
    store = loaded.model.experts
    return store.experts[0][0].nbytes


def outcomes(path: Path, weights: str = "f32", **options) -> tuple[list, LLMEngine]:
    """test_batch_invariance's outcomes (tokens, logprobs with top-k) of a greedy and two
    seeded requests, on a fresh engine (closed after: its histogram is saved)."""
    from test_batch_invariance import outcomes as run

    engine = LLMEngine(EngineConfig(model=str(path), weights=weights, num_kv_blocks=64,
                                    threads=1, **options))
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True, logprobs=2)]
    result = run(engine, PROMPTS, sps)
    engine.close()
    return result, engine


# ------------------------------------------------------------------ resident vs transformers
@pytest.mark.slow
def test_resident_logits_and_greedy_match_transformers(moe_gguf: Path, resident) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf = transformers_from_gguf(moe_gguf, moe_intermediate_size=128, norm_topk_prob=True)
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0]
    ours = resident.model.score(IDS)
    assert (ours - theirs).abs().max().item() < ATOL
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([IDS[:20]]), max_new_tokens=16, do_sample=False,
                             min_new_tokens=16)[0, 20:].tolist()
    engine = LLMEngine(EngineConfig(model=str(moe_gguf), weights="f32", num_kv_blocks=64),
                       loaded=resident)
    req = engine.add_request(IDS[:20], SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert list(req.output_ids) == greedy


def test_config_and_router(resident) -> None:
    cfg = resident.config
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_size) == (N_EXPERTS, N_USED, 128)
    layer = resident.model.layers[0]
    assert layer.gate_up is None and layer.moe is not None
    assert resident.model.native is None


# ------------------------------------------------------------------ streamed == resident
@pytest.mark.parametrize("budget", ["none", "one_per_layer", "half", "all"])
def test_streamed_equals_resident_bitwise(model_copy: Path, resident, budget: str) -> None:
    one = expert_bytes(resident)
    cache = {"none": 1, "one_per_layer": one * N_LAYERS, "half": one * N_LAYERS * N_EXPERTS // 2,
             "all": one * N_LAYERS * N_EXPERTS}[budget]
    want, _ = outcomes(model_copy)
    got, engine = outcomes(model_copy, moe_stream=True, moe_cache_bytes=cache)
    assert got == want
    stats = engine.moe_metrics()
    assert stats["streamed"] and stats["cached_bytes"] <= max(cache, 0)
    lookups = stats["pinned_hits"] + stats["lru_hits"] + stats["misses"]
    assert lookups > 0 and stats["bytes_read"] > 0
    if budget == "none":
        assert stats["hit_rate"] == 0.0
    if budget == "all":
        assert stats["misses"] <= N_LAYERS * N_EXPERTS  # each expert read once at most


@pytest.mark.parametrize("cache, pilot", [(1, True), (1, False), (100_000, True),
                                          (10**9, False)])
def test_q4_streamed_equals_q4_resident(model_copy: Path, cache: int, pilot: bool) -> None:
    """The native stack's routed experts, streamed at budgets from nothing (every expert
    read when needed, a layer's in chunks) to all, with the pilot reading ahead or not."""
    require_kernels()
    want, resident = outcomes(model_copy, weights="q4")
    got, streamed = outcomes(model_copy, weights="q4", moe_stream=True, moe_cache_bytes=cache,
                             moe_pilot=pilot)
    assert resident.loaded.model.native is not None and streamed.loaded.model.native is not None
    assert got == want
    stats = streamed.moe_metrics()
    assert stats["misses"] > 0 and stats["tokens_routed"] == resident.moe_metrics()["tokens_routed"]
    assert (stats["pilot_reads"] > 0) == pilot


# ------------------------------------------------------------------ the native stack
def test_q4_routed_experts_run_in_the_native_stack(moe_gguf: Path, resident) -> None:
    """Routing, grouping and the experts' products natively: the op-by-op path on the
    same packed weights (the same int8 activations: a last-bit difference may flip a
    code) and the f32 oracle (q4's rounding) give the same logits to their error."""
    require_kernels()
    q4 = load_model(str(moe_gguf), "q4").model
    assert q4.batch_invariant
    fused, rel = fused_vs_op_by_op(q4, IDS)
    assert rel < 0.02, rel
    oracle = resident.model.score(IDS)
    assert ((fused - oracle).norm() / oracle.norm()).item() < 0.05
    assert (fused.argmax(-1) == oracle.argmax(-1)).float().mean() > 0.9


def test_q4_routed_experts_are_batch_invariant(moe_gguf: Path) -> None:
    from test_batch_invariance import outcomes as run
    from test_batch_invariance import params, random_prompts

    require_kernels()
    q = load_model(str(moe_gguf), "q4")
    prompts = random_prompts(4, seed=3, lo=1, hi=40)
    sps = [params(i, max_tokens=8) for i in range(4)]

    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(moe_gguf), weights="q4", num_kv_blocks=64),
                         loaded=q)

    alone = [run(make(), [p], [sp])[0] for p, sp in zip(prompts, sps, strict=True)]
    assert run(make(), prompts, sps) == alone


@pytest.fixture(scope="module")
def kquant_moe(tmp_path_factory: pytest.TempPathFactory, smollm2_file) -> Path:
    """A tiny Qwen3-MoE of llama-quantize's Q4_K_M types: Q4_K experts (down Q6_K in the
    last layer), so activations are quantized per 256 (the Q8_0 model's are per 32)."""
    from ember.bench.synth import Shape, write_synth

    shape = Shape("tiny-moe", "qwen3moe", hidden=256, n_layers=3, n_heads=4, n_kv_heads=2,
                  head_dim=64, ffn=512, vocab=49152, tied=False, rope_base=1e6,
                  context=2048, norm_eps=1e-6, n_experts=8, n_experts_used=2,
                  expert_ffn=256)
    path = tmp_path_factory.mktemp("kquant-moe") / "tiny-moe-Q4_K_M.gguf"
    types = write_synth(path, shape, "Q4_K_M", smollm2_file)
    assert types["blk.0.ffn_gate_exps.weight"].name == "Q4_K"
    assert types["blk.2.ffn_down_exps.weight"].name == "Q6_K"
    return path


def test_k_quant_experts_in_the_native_stack(kquant_moe: Path) -> None:
    require_kernels()
    model = load_model(str(kquant_moe), "q4").model
    _, rel = fused_vs_op_by_op(model, IDS)
    assert rel < 0.02, rel
    want = model.score(IDS)
    streamed = load_model(str(kquant_moe), "q4", MoEOptions(stream=True, cache_bytes=1))
    assert torch.equal(streamed.model.score(IDS), want)
    streamed.model.experts.close()


@pytest.mark.slow
@pytest.mark.parametrize("pilot", [False, True])
def test_a_layer_routed_to_every_expert_is_computed_in_chunks(
        tmp_path: Path, smollm2_file, monkeypatch, pilot: bool) -> None:
    """Native, streamed with no cache: a prefill that routes to all of a layer's 16
    experts holds at most a chunk of them (READ_AHEAD) plus the reads in flight (and the
    pilot's, READ_AHEAD where the cache keeps none), not the layer."""
    from ember.bench.moe_model import write_moe_gguf

    require_kernels()
    path = write_moe_gguf(tmp_path / "wide.gguf", smollm2_file, n_layers=N_LAYERS,
                          n_experts=16, n_used=2, hidden=64, expert_ffn=64, seed=2)
    alive = count_built_experts(monkeypatch)
    loaded = load_model(str(path), "q4", MoEOptions(stream=True, cache_bytes=1, pilot=pilot))
    store = loaded.model.experts
    provide, calls, most = store._provide, [], 0  # noqa: SLF001

    def counting(layer, needed):
        nonlocal most
        done = provide(layer, needed)
        calls.append((layer, len(needed), done))
        most = max(most, alive())
        return done

    monkeypatch.setattr(store, "_provide", counting)
    for layer in range(N_LAYERS):  # the providers were bound at load: bind again
        for native, _ in store._attached.layers[layer]:  # noqa: SLF001
            native.set_provider(lambda n, layer=layer: store._provide(layer, n))  # noqa: SLF001
    loaded.model.score(list(range(5, 900, 3)))  # 299 tokens: every expert of every layer
    assert {(layer, n) for layer, n, _ in calls if n == 16} == {
        (layer, 16) for layer in range(N_LAYERS)}
    assert all(done <= READ_AHEAD for _, _, done in calls)
    assert 1 <= most <= (3 if pilot else 2) * READ_AHEAD < 16
    store.close()


def test_the_pilot_guesses_what_the_next_layer_needs_where_the_stream_tells(
        tmp_path: Path, smollm2_file) -> None:
    """One token at a time, every layer routing with a router of its own, layers adding
    almost nothing to the stream: the next layer's router on this layer's state picks
    what it will need, so nearly every needed expert was guessed and read ahead (a
    guess made with any other router would be right about a quarter of the time)."""
    from ember.bench.moe_model import write_moe_gguf
    from ember.models.moe import MoEStats

    require_kernels()
    path = write_moe_gguf(tmp_path / "pilot.gguf", smollm2_file, n_layers=4, n_experts=16,
                          n_used=2, hidden=64, expert_ffn=64, seed=5, branch_scale=1e-3)
    engine = LLMEngine(EngineConfig(model=str(path), weights="q4", num_kv_blocks=64,
                                    moe_stream=True, moe_cache_bytes=1, moe_pilot=True,
                                    speculation="off"))
    store = engine.loaded.model.experts
    engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, seed=1, max_tokens=48,
                                                  ignore_eos=True))  # tokens vary
    engine.step()  # the prompt
    store.stats = MoEStats()
    while engine.has_unfinished():
        engine.step()
    stats = store.stats
    assert stats.pilot_needed == 47 * 3 * 2  # decode steps x guessed layers x k
    assert stats.pilot_recall >= 0.95  # its two guesses agree: each read once, and used
    assert stats.pilot_used == stats.pilot_reads == stats.pilot_guessed
    engine.close()


def test_pilot_recall_counts_needed_experts_that_were_guessed(model_copy: Path) -> None:
    """The store's bookkeeping, call by call: a layer's guesses are counted together,
    recall is guessed-and-needed over needed, wrong guesses' reads are dropped, a
    guessed expert the layer then needs is taken from the pilot's read."""
    store = load_model(str(model_copy), "q4", MoEOptions(stream=True, cache_bytes=1)
                       ).model.experts
    store.stats = type(store.stats)()
    store._guess(1, [1, 2])  # noqa: SLF001 - after layer 0's attention
    store._guess(1, [2, 3])  # noqa: SLF001 - after layer 0's experts
    assert store.stats.pilot_reads == 3
    assert store._provide(1, [2, 5]) == 2  # noqa: SLF001
    s = store.stats
    assert (s.pilot_needed, s.pilot_guessed, s.pilot_used, s.misses) == (2, 1, 1, 2)
    assert s.pilot_recall == 0.5
    assert not any(layer == 1 and e in (1, 3) for layer, e in store._reads)  # noqa: SLF001
    store.end_step()
    store.close()


def test_top_p_keeps_each_tokens_experts_up_to_that_weight(moe_gguf: Path) -> None:
    """--moe-expert-top-p: the native router and the op-by-op one keep the same experts;
    a token keeps its first experts until their weight reaches p, renormalised; p = 1
    keeps all k of every token (the exact model), below 1 the answer changes."""
    from ember import kernels

    require_kernels()
    ext = kernels.quant_matmul()
    exact = load_model(str(moe_gguf), "q4")
    cut = load_model(str(moe_gguf), "q4", MoEOptions(top_p=0.6))
    h = torch.randn(40, exact.config.hidden_size)
    for loaded in (exact, cut):
        moe = loaded.model.layers[0].moe
        chosen, weights = moe.route(h)
        native = ext.RoutedExperts(moe.router, moe.top_k, loaded.config.expert_ffn_size)
        native.set_top_p(moe.top_p)
        ids, w = native.route(h)
        assert torch.equal(ids.long(), chosen)
        assert torch.allclose(w, weights.float(), atol=1e-6)
    probs = torch.softmax(h @ exact.model.layers[0].moe.router.T, dim=-1).topk(N_USED).values
    probs = probs / probs.sum(-1, keepdim=True)
    kept = (cut.model.layers[0].moe.route(h)[0] >= 0).sum(-1)
    assert torch.equal(kept, torch.where(probs[:, 0] >= 0.6, 1, 2))  # k = 2
    assert 0 < int((kept == 1).sum()) < len(h)
    assert not torch.equal(cut.model.score(IDS), exact.model.score(IDS))
    whole = ext.RoutedExperts(exact.model.layers[0].moe.router, N_USED,
                              exact.config.expert_ffn_size)
    whole.set_top_p(1.0)
    ids, w = whole.route(h)
    assert bool((ids >= 0).all()) and torch.allclose(w.sum(-1), torch.ones(len(h)))


def test_native_routing_and_a_shared_expert_against_the_formula() -> None:
    """RoutedExperts alone, against the layer written out in torch: softmax over the
    chosen logits, each expert's SiLU FFN weighted, plus a shared expert scaled by
    sigmoid(gate . h) (Qwen 3.5 MoE's) and gpt-oss's biases."""
    import gguf as gguf_py

    from ember.models.gguf import GGMLType
    from ember.models.linear import QuantLinear

    ext = require_kernels()
    gen = torch.Generator().manual_seed(0)
    E, k, H, F = 6, 3, 64, 96

    def q8(rows: int, cols: int) -> QuantLinear:
        w = (torch.randn(rows, cols, generator=gen) / cols**0.5).numpy()
        raw = gguf_py.quants.quantize(w, gguf_py.GGMLQuantizationType.Q8_0).reshape(-1)
        return QuantLinear.from_raw([(raw, GGMLType.Q8_0, (rows, cols))])

    def wrap(lin: QuantLinear):
        return ext.PackedLinear(lin.in_features, lin.packed.segments)

    router = torch.randn(E, H, generator=gen)
    experts = [(q8(2 * F, H), q8(H, F)) for _ in range(E)]
    shared = (q8(2 * 64, H), q8(H, 64))
    gate = torch.randn(H, generator=gen) / H**0.5
    b_router, b_gu = torch.randn(E, generator=gen), torch.randn(E, 2 * F, generator=gen)
    b_down = torch.randn(E, H, generator=gen)
    native = ext.RoutedExperts(router, k, F, "silu")
    for e, (gu, down) in enumerate(experts):
        native.set_expert(e, wrap(gu), wrap(down))
    native.set_shared(wrap(shared[0]), wrap(shared[1]), gate)
    native.set_biases(b_router, b_gu, b_down)
    h = torch.randn(9, H, generator=gen)
    want = torch.zeros_like(h)
    for t in range(len(h)):
        top = (router @ h[t] + b_router).topk(k)
        for w, e in zip(torch.softmax(top.values, 0), top.indices.tolist(), strict=True):
            g, u = (experts[e][0](h[t:t + 1]) + b_gu[e]).chunk(2, dim=-1)
            want[t] += w * (experts[e][1](torch.nn.functional.silu(g) * u)[0] + b_down[e])
        g, u = shared[0](h[t:t + 1]).chunk(2, dim=-1)
        want[t] += torch.sigmoid(gate @ h[t]) * shared[1](torch.nn.functional.silu(g) * u)[0]
    got = native.forward(h)
    assert ((got - want).norm() / want.norm()).item() < 1e-3


def test_bytes_read_are_the_misses(model_copy: Path, resident) -> None:
    loaded = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=1))
    store = loaded.model.experts
    loaded.model.score(IDS)
    raw = store.layers[0].expert_bytes
    assert store.stats.bytes_read == store.stats.misses * raw
    assert store.stats.pinned_hits == store.stats.lru_hits == 0


# ------------------------------------------------------------------ the histogram
def test_histogram_is_saved_and_pins_the_hottest_experts_next_time(model_copy: Path,
                                                                   resident) -> None:
    cache = expert_bytes(resident) * N_LAYERS * 4
    _, engine = outcomes(model_copy, moe_stream=True, moe_cache_bytes=cache)
    sidecar = Path(str(model_copy) + HISTOGRAM_SUFFIX)
    data = json.loads(sidecar.read_text())
    histogram = data["histogram"]
    assert sum(map(sum, histogram)) == engine.moe_metrics()["tokens_routed"]
    assert not list(model_copy.parent.glob("*.tmp"))
    again = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=cache,
                                                          pinned_share=0.5))
    pinned = again.model.experts.pinned
    assert pinned and sum(x.nbytes for x in pinned.values()) <= 0.5 * cache
    hottest = max((count, layer, e) for layer, h in enumerate(histogram)
                  for e, count in enumerate(h))
    assert (hottest[1], hottest[2]) in pinned
    # pinned experts are what a run then finds first
    again.model.score(IDS)
    assert again.model.experts.stats.pinned_hits > 0


def test_a_restart_starts_each_layers_cache_with_its_hottest_experts(model_copy: Path,
                                                                     resident) -> None:
    """By default nothing is pinned: the histogram warms the LRU, hottest last to go."""
    cache = expert_bytes(resident) * N_LAYERS * 3  # three of each layer's eight
    outcomes(model_copy, moe_stream=True, moe_cache_bytes=cache)
    histogram = json.loads(Path(str(model_copy) + HISTOGRAM_SUFFIX).read_text())["histogram"]
    store = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=cache)
                       ).model.experts
    assert PINNED_SHARE == 0 and not store.pinned
    for layer, h in enumerate(histogram):
        warm = list(store._caches[layer].lru)  # noqa: SLF001 - least recently used first
        assert len(warm) == 3
        assert sorted(warm, key=lambda e: h[e]) == warm  # the hottest is evicted last
        assert min(h[e] for e in warm) >= sorted(h, reverse=True)[2]
    assert store.stats.misses == store.stats.lru_hits == 0  # warming is not serving
    list(store.experts_for(0, [max(range(N_EXPERTS), key=lambda e: histogram[0][e])]))
    assert store.stats.lru_hits == 1  # the hottest is there from the start
    store.close()


def test_a_damaged_sidecar_is_ignored(model_copy: Path) -> None:
    sidecar = Path(str(model_copy) + HISTOGRAM_SUFFIX)
    sidecar.write_text("{not json")
    loaded = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=10**6))
    assert not loaded.model.experts.pinned
    loaded.model.score(IDS[:8])


# ------------------------------------------------------------------ a damaged model file
def damage(path: Path, loaded, layer: int, expert: int, keep_mtime: bool = False) -> None:
    """Flip a byte inside one expert's slice, in place (``keep_mtime``: and put the file's
    times back, as silent corruption on the device would leave them)."""
    st = path.stat()
    _, offset, size = loaded.model.experts.layers[layer].spans(expert)[0]
    with open(path, "r+b") as f:
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(offset + size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("weights", ["f32", "q4"])  # op by op, and the native stack
def test_a_corrupted_expert_fails_the_request_with_a_clear_error(model_copy: Path,
                                                                 weights: str) -> None:
    if weights == "q4":
        require_kernels()
    # no prefix cache: the second request recomputes the prompt, routed as the first
    engine = LLMEngine(EngineConfig(model=str(model_copy), weights=weights, num_kv_blocks=64,
                                    moe_stream=True, moe_cache_bytes=1,
                                    enable_prefix_caching=False))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], sp)
    while engine.has_unfinished():
        engine.step()
    assert first.finish_reason.value == "length"
    # every expert this prompt used was read (and checksummed): damage one of them
    store = engine.loaded.model.experts
    layer, e = next(k for k in sorted(store._crc))  # noqa: SLF001
    damage(model_copy, engine.loaded, layer, e, keep_mtime=True)
    again = engine.add_request(PROMPTS[0], sp)
    while engine.has_unfinished():
        engine.step()
    assert again.finish_reason.value == "error"
    assert f"expert {e} of layer {layer}" in again.error and "CRC32" in again.error
    engine.kv.check_no_leaks()


def test_a_truncated_file_fails_the_request_with_a_clear_error(model_copy: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(model_copy), weights="f32", num_kv_blocks=64,
                                    moe_stream=True, moe_cache_bytes=1))
    os.truncate(model_copy, model_copy.stat().st_size // 2)
    req = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason.value == "error"
    assert "changed since it was loaded" in req.error or "short read" in req.error


def test_a_file_changed_in_place_fails_even_an_expert_never_read(model_copy: Path) -> None:
    """GGUF has no checksums: an expert's first read is trusted only because the file is
    still the one parsed (same inode, size and mtime)."""
    loaded = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=1))
    store = loaded.model.experts
    assert not store._crc  # noqa: SLF001  (nothing read yet)
    damage(model_copy, loaded, 1, 3)
    with pytest.raises(ExpertReadError, match="changed since it was loaded"):
        list(store.experts_for(1, [3]))
    store.close()


def test_a_file_replaced_after_parsing_is_refused(model_copy: Path) -> None:
    from ember.models.gguf import GGUFFile
    from ember.models.moe import StreamedExperts, expert_slices

    gguf = GGUFFile(model_copy)
    slices = [expert_slices(gguf, i) for i in range(N_LAYERS)]
    other = model_copy.with_name("other.gguf")
    shutil.copy(model_copy, other)
    os.replace(other, model_copy)  # same bytes, another file: offsets are not its own
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ExpertReadError, match="replaced"):
        StreamedExperts(gguf.parts, slices, lambda *a: None, 1)
    assert len(os.listdir("/proc/self/fd")) == fds  # nothing left open by the failed start


def test_expert_stacks_that_disagree_with_the_router_are_refused(model_copy: Path,
                                                                  tmp_path: Path) -> None:
    """A file claiming more experts than its stacks hold would have experts read from the
    next tensor's bytes: it is refused at load, naming the tensor."""
    from hf_gguf import rewrite_gguf

    from ember.errors import UnsupportedModelError

    bad = rewrite_gguf(model_copy, tmp_path / "bad.gguf",
                       add_keys={"qwen3moe.expert_count": N_EXPERTS + 1})
    for options in (MoEOptions(), MoEOptions(stream=True)):
        with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_gate_exps\.weight is"):
            load_model(str(bad), "f32", options)


def test_a_history_that_does_not_read_back_leaves_the_cache_cold(model_copy: Path,
                                                                 resident) -> None:
    """Warming from a sidecar whose checksums disagree with the file: a warning, a cold
    cache, a model that loads (the damage, if real, fails the step that reads it)."""
    cache = expert_bytes(resident) * N_LAYERS * 3
    outcomes(model_copy, moe_stream=True, moe_cache_bytes=cache)
    sidecar = Path(str(model_copy) + HISTOGRAM_SUFFIX)
    data = json.loads(sidecar.read_text())
    data["crc32"] = {k: (v + 1) % 2**32 for k, v in data["crc32"].items()}
    sidecar.write_text(json.dumps(data))
    store = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=cache)
                       ).model.experts
    assert store.cached_bytes == 0 and not store.pinned
    store.close()


@pytest.mark.parametrize("text", ["[]", "null", '{"histogram": 3}', '{"histogram": [1, 2]}',
                                  "IDENTITY_WITH_BAD_CRC", "IDENTITY_WITH_BAD_COUNTS"])
def test_a_malformed_histogram_file_is_ignored(model_copy: Path, text: str) -> None:
    from ember.models.gguf import file_identity

    identity = list(file_identity(os.stat(model_copy)))
    good = [[0] * N_EXPERTS for _ in range(N_LAYERS)]
    text = {"IDENTITY_WITH_BAD_CRC": json.dumps({"file": identity, "histogram": good,
                                                 "crc32": {"3": 5}}),
            "IDENTITY_WITH_BAD_COUNTS": json.dumps({"file": identity, "histogram": [
                ["x"] * N_EXPERTS for _ in range(N_LAYERS)]})}.get(text, text)
    Path(str(model_copy) + HISTOGRAM_SUFFIX).write_text(text)
    loaded = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=1))
    store = loaded.model.experts
    assert store.histogram == good and not store.pinned
    store.close()


def test_a_layer_routed_to_every_expert_holds_only_a_read_ahead_window(
        model_copy: Path, monkeypatch) -> None:
    """Prefill can route to all of a layer's experts: those the cache cannot keep live
    only while computed (plus the read-ahead), not all at once."""
    alive = count_built_experts(monkeypatch)
    loaded = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=1))
    store = loaded.model.experts
    most = 0
    for _e, expert in store.experts_for(0, list(range(N_EXPERTS))):
        most = max(most, alive())
        assert expert is not None
    assert N_EXPERTS > READ_AHEAD + 1 and 1 <= most <= READ_AHEAD + 1
    store.close()


def count_built_experts(monkeypatch) -> Callable[[], int]:
    """From now on, a count of the experts built and still alive (garbage collected
    first)."""
    import gc
    import weakref

    from ember.models import moe

    built: list[weakref.ref] = []
    build = moe.build_expert

    def tracked(*args):
        expert = build(*args)
        built.append(weakref.ref(expert))
        return expert

    monkeypatch.setattr(moe, "build_expert", tracked)

    def alive() -> int:
        gc.collect()
        return sum(r() is not None for r in built)

    return alive
