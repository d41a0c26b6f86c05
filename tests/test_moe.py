"""Mixture of experts (Qwen3-MoE): the resident path against transformers, and experts
streamed from disk against the resident path, on random-weight GGUFs written here.

transformers reads the same file (its GGUF reader and Qwen3-MoE code; it maps neither
the experts' FFN size nor Qwen3's renormalised top-k from the GGUF, so both are
passed): float32 logits agree to 4e-6 (|logits| ~5), ``ATOL`` leaves 25x headroom.
Streaming changes where an expert's bytes come from, never the arithmetic, so
streamed and resident runs must agree to the bit at every cache budget.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hf_gguf import transformers_from_gguf
from native import require_kernels

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.loader import load_model
from ember.models.moe import HISTOGRAM_SUFFIX, PINNED_SHARE, ExpertReadError, MoEOptions
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


def test_q4_streamed_equals_q4_resident(model_copy: Path) -> None:

    require_kernels()
    want, _ = outcomes(model_copy, weights="q4")
    got, _ = outcomes(model_copy, weights="q4", moe_stream=True, moe_cache_bytes=100_000)
    assert got == want


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
    again = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=cache))
    pinned = again.model.experts.pinned
    assert pinned and sum(x.nbytes for x in pinned.values()) <= PINNED_SHARE * cache
    hottest = max((count, layer, e) for layer, h in enumerate(histogram)
                  for e, count in enumerate(h))
    assert (hottest[1], hottest[2]) in pinned
    # pinned experts are what a run then finds first
    again.model.score(IDS)
    assert again.model.experts.stats.pinned_hits > 0


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


def test_a_corrupted_expert_fails_the_request_with_a_clear_error(model_copy: Path) -> None:
    # no prefix cache: the second request recomputes the prompt, routed as the first
    engine = LLMEngine(EngineConfig(model=str(model_copy), weights="f32", num_kv_blocks=64,
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
    with pytest.raises(ExpertReadError, match="replaced"):
        StreamedExperts(model_copy, slices, lambda *a: None, 1, identity=gguf.identity)


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
    loaded = load_model(str(model_copy), "f32", MoEOptions(stream=True, cache_bytes=1))
    store = loaded.model.experts
    most = 0
    for _e, expert in store.experts_for(0, list(range(N_EXPERTS))):
        gc.collect()
        most = max(most, sum(r() is not None for r in built))
        assert expert is not None
    assert N_EXPERTS > moe.READ_AHEAD + 1 and 1 <= most <= moe.READ_AHEAD + 1
    store.close()
