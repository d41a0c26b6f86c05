"""The prefix cache's disk tier in the engine (ember.kv.tier): exact, isolated, bounded.

A "restart" is a new engine over the same ``kv_cache_dir``, which starts with an
empty RAM cache: whatever it reuses came from disk. (tests/e2e/test_kv_restart.py
kills a real server instead.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine import GREEDY, prompts, run

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.kv.prefix import extend_keys
from ember.sampling.params import SamplingParams


def disk_engine(make, root: Path, **options) -> LLMEngine:
    options.setdefault("kv_restore", "always")  # the tiny model recomputes faster than disk
    return make(kv_cache_dir=str(root), **options)


def cached_blocks(engine: LLMEngine, tokens: list[int], tenant: str | None = None) -> list[int]:
    salt = engine.intake.salt_for(tenant)
    keys: list[bytes] = []
    extend_keys(keys, salt, tokens, engine.config.block_size)
    return [hit.block for hit in engine.kv.prefix.lookup(salt, tokens, keys)]


@pytest.mark.parametrize("tiny,kv_dtype", [("make_tiny_engine", "f32"),
                                           ("make_tiny32_engine", "q8_0")])
def test_restored_blocks_are_bytewise_the_computed_ones_and_serve_the_same_tokens(
        request, tmp_path, tiny: str, kv_dtype: str):
    """In every KV dtype, q8_0's blocks of scales and codes included."""
    make = request.getfixturevalue(tiny)

    def make_tiny_engine(**options) -> LLMEngine:
        return make(kv_dtype=kv_dtype, **options)

    ps = prompts(4, seed=31, lo=40, hi=90)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    # no speculation: its gate learns step costs per engine, so two engines may verify
    # different drafts, which changes the shapes of the work (and the last bits)
    first = disk_engine(make_tiny_engine, tmp_path, speculation="off")
    run(first, [(p, params) for p in ps])
    # one at a time, so that both runs have the same batch shapes (padding to another
    # row's length in a step changes the last bits)
    ram = [run(first, [(p, params)])[0] for p in ps]  # RAM hits: the tail is recomputed
    first.close()
    restarted = disk_engine(make_tiny_engine, tmp_path, speculation="off")
    disk = [run(restarted, [(p, params)])[0] for p in ps]
    for p, a, b in zip(ps, ram, disk, strict=True):
        assert b.cached_tokens == a.cached_tokens > 0
        assert b.token_ids == a.token_ids and b.logprobs == a.logprobs  # bitwise floats
        n = b.cached_tokens // restarted.config.block_size  # the blocks it restored
        old, new = cached_blocks(first, p)[:n], cached_blocks(restarted, p)[:n]
        assert len(new) == len(old) == n > 0
        for x, y in zip(old, new, strict=True):
            assert first.runner.kv.block_bytes(x) == restarted.runner.kv.block_bytes(y)
    assert restarted.runner.kv.pool.dtype == restarted.runner.kv.kv_dtype.storage
    assert restarted.runner.kv.kv_dtype.name == kv_dtype
    assert restarted.transfer.disk is not None and restarted.transfer.disk.stats.hits > 0
    assert restarted.transfer.disk.stats.corrupt == 0
    restarted.kv.check_no_leaks()


def test_another_tenant_model_format_dtype_or_block_size_never_reuses_blocks(
        make_tiny_engine, tmp_path, tiny_gguf, smollm2_file):
    from tiny_model import write_tiny_llama

    p = prompts(1, seed=32, lo=70, hi=71)[0]
    first = disk_engine(make_tiny_engine, tmp_path)
    want = run(first, [(p, GREEDY)], tenant="a")[0].token_ids
    first.close()
    again = disk_engine(make_tiny_engine, tmp_path)
    assert run(again, [(p, GREEDY)], tenant="a")[0].cached_tokens > 0  # the control

    other = write_tiny_llama(tmp_path / "other.gguf", smollm2_file, seed=1)
    for tenant, options in [("b", {}), ("a", {"kv_dtype": "bf16"}), ("a", {"block_size": 8}),
                            ("a", {"model": str(other), "loaded": None})]:
        if "model" in options:
            engine = LLMEngine(EngineConfig(model=options["model"], weights="f32",
                                            num_kv_blocks=256, kv_cache_dir=str(tmp_path),
                                            kv_restore="always"))
        else:
            engine = disk_engine(make_tiny_engine, tmp_path, **options)
        out = run(engine, [(p, GREEDY)], tenant=tenant)[0]
        assert out.cached_tokens == 0, (tenant, options)
        disk = engine.transfer.disk
        assert disk is not None and disk.stats.hits == 0, (tenant, options)
        if "model" not in options and options.get("kv_dtype") is None:
            assert out.token_ids == want  # same model: recomputed, the same tokens


def test_the_disk_budget_is_respected_and_restores_stay_in_the_pool(make_tiny_engine,
                                                                    tmp_path):
    engine = disk_engine(make_tiny_engine, tmp_path, num_kv_blocks=12, kv_disk_bytes=1)
    run(engine, [(prompts(1, seed=33, lo=40, hi=41)[0], GREEDY)])
    engine.close()
    assert engine.transfer.disk is not None
    stats = engine.transfer.disk.stats
    # 1 byte fits none
    assert stats.evicted > 0 and not list(engine.transfer.disk.dir.glob("*.kvb"))
    budget = 5 * (stats.bytes_written // stats.evicted)  # five block files
    engine = disk_engine(make_tiny_engine, tmp_path, num_kv_blocks=12, kv_disk_bytes=budget)
    ps = prompts(6, seed=34, lo=60, hi=90)  # 4-5 blocks each, 12 blocks in RAM
    for p in ps:
        run(engine, [(p, GREEDY)])
    engine.close()
    files = list(engine.transfer.disk.dir.glob("*.kvb"))
    assert 0 < sum(f.stat().st_size for f in files) <= budget
    # restores go into the pool's 12 blocks, evicting cached ones, never beyond
    again = disk_engine(make_tiny_engine, tmp_path, num_kv_blocks=12, kv_disk_bytes=budget)
    out = run(again, [(ps[-1], GREEDY)])[0]
    assert out.cached_tokens > 0
    assert again.runner.kv.pool.shape[0] == 12
    again.kv.check_no_leaks()


@pytest.mark.parametrize("restore", ["auto", "always"])
def test_restore_or_recompute_is_decided_and_counted(make_tiny_engine, tmp_path, restore):
    p = prompts(1, seed=35, lo=80, hi=81)[0]
    first = disk_engine(make_tiny_engine, tmp_path)
    run(first, [(p, GREEDY)])
    first.close()
    engine = disk_engine(make_tiny_engine, tmp_path, kv_restore=restore)
    assert engine.kv.tier is not None
    engine.kv.tier.read_bps = 1.0  # a disk this slow never pays
    out = run(engine, [(p, GREEDY)])[0]
    decided = engine.kv.tier.decisions
    if restore == "auto":
        assert out.cached_tokens == 0 and decided["recompute"] >= 1 and decided["restore"] == 0
    else:
        assert out.cached_tokens > 0 and decided["restore"] >= 1


def test_a_prefix_being_read_from_disk_holds_up_only_its_own_request(make_tiny_engine,
                                                                      tmp_path):
    p, other = prompts(2, seed=36, lo=80, hi=81)
    first = disk_engine(make_tiny_engine, tmp_path)
    run(first, [(p, GREEDY)])
    first.close()
    engine = disk_engine(make_tiny_engine, tmp_path)
    tier = engine.kv.tier
    assert tier is not None
    read = tier._read
    gate = __import__("threading").Event()

    def slow_read(keys):
        gate.wait(10)  # the disk is slow until the test says otherwise
        return read(keys)

    tier._read = slow_read
    loading = engine.add_request(p, GREEDY)
    fresh = engine.add_request(other, GREEDY)
    for _ in range(5):
        engine.step()
    assert fresh.num_output > 0 and loading.num_output == 0  # the other one went ahead
    assert not loading.block_table.blocks  # waiting for its read, it holds no KV
    gate.set()
    while engine.has_unfinished():
        engine.step()
    assert loading.cached_tokens > 0 and tier.decisions["restore"] == 1
    engine.kv.check_no_leaks()
