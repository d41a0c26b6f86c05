"""Tenants share compute, not state: a KV block handed to a new owner is zero before it
can be read, and a tenant's cached prefixes can be purged from RAM and disk."""

from __future__ import annotations

import pytest
import torch

from ember.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(engine, prompt: list[int], tenant: str):
    req = engine.add_request(prompt, GREEDY, tenant=tenant)
    while engine.has_unfinished():
        engine.step()
    return req


def test_a_freed_block_is_zero_before_another_tenant_can_read_it(make_tiny_engine) -> None:
    """Tenant A's blocks, freed (no prefix cache to keep them), still hold its keys and
    values; when tenant B is handed them, every one reads zero before B's first step
    writes into it."""
    engine = make_tiny_engine(num_kv_blocks=8, enable_prefix_caching=False)
    pool = engine.runner.kv.pool
    a = engine.add_request(list(range(100, 160)), GREEDY, tenant="a")
    held: list[int] = []
    while engine.has_unfinished():
        engine.step()
        held = held or list(a.block_table.blocks)
    assert held and all(pool[b].abs().sum() > 0 for b in held)  # A's data stayed behind
    seen: dict[int, int] = {}  # block -> nonzero values when handed to B's first step
    execute = engine.runner.execute

    def checked(rows):  # (the engine catches what a step raises: record, assert later)
        for row in rows:
            if row.start == 0:  # the request's first step: nothing of its own written yet
                for block in row.request.block_table.blocks:
                    seen[block] = int(torch.count_nonzero(pool[block]))
        return execute(rows)

    engine.runner.execute = checked
    b = _run(engine, list(range(300, 350)), "b")
    assert b.finish_reason is not None and len(b.output_ids) == GREEDY.max_tokens
    assert set(seen) & set(held)  # B was given some of A's blocks...
    assert not any(seen.values()), seen  # ...and every block it was given read zero
    engine.kv.check_no_leaks()


def test_purging_a_tenant_forgets_its_prefixes_in_ram_and_on_disk(
        make_tiny_engine, tmp_path) -> None:
    """Tenants "a" and "ab" cache the same text; purging "a" removes its blocks from RAM
    and its files from the disk tier (and nothing of "ab"'s): its follow-up recomputes
    everything, "ab"'s is still cached."""
    from pathlib import Path

    engine = make_tiny_engine(num_kv_blocks=64, kv_cache_dir=str(tmp_path),
                              kv_restore="always", kv_fsync="never")
    prompt = list(range(100, 100 + 4 * 16 + 3))
    for tenant in ("a", "ab"):
        _run(engine, prompt, tenant)
    engine.transfer.disk.flush()
    files = lambda: sorted(Path(engine.transfer.disk.dir).glob("*.kvb"))  # noqa: E731
    before = files()
    assert len(before) == 2 * 4  # both tenants' four full blocks spilled (they finished)
    sizes = sum(f.stat().st_size for f in before)
    removed = engine.purge_cache("a")
    removed.update(engine.purge_disk("a"))
    assert removed["ram_blocks"] == 4 and removed["disk_blocks"] == 4
    assert len(files()) == 4
    assert removed["disk_bytes"] == sizes - sum(f.stat().st_size for f in files())
    again = _run(engine, prompt, "a")
    assert again.cached_tokens == 0  # neither RAM nor disk had it
    assert _run(engine, prompt, "ab").cached_tokens == 4 * 16
    engine.kv.check_no_leaks()


def test_a_purge_frees_blocks_a_running_request_holds_when_it_finishes(
        make_tiny_engine) -> None:
    engine = make_tiny_engine(num_kv_blocks=64)
    prompt = list(range(100, 100 + 3 * 16 + 1))
    _run(engine, prompt, "a")
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True), tenant="a")
    engine.step()
    assert req.cached_tokens == 3 * 16
    assert engine.purge_cache("a")["ram_blocks"] >= 3  # held by the running request
    while engine.has_unfinished():
        engine.step()
    engine.kv.check_no_leaks()  # the purged blocks it held were freed, none leaked
    assert _run(engine, prompt, "a").cached_tokens == 0


def test_a_tenants_scope_is_its_salt_with_or_without_an_adapter_and_no_other() -> None:
    from ember.kv.prefix import tenant_salt, tenant_scope

    model = b"model-fingerprint"
    scope = tenant_scope(model, "a")
    assert scope(tenant_salt(model, "a")) and scope(tenant_salt(model, "a", b"\x01" * 32))
    assert not scope(tenant_salt(model, "ab")) and not scope(tenant_salt(model, "b"))
    assert not scope(tenant_salt(b"another-model", "a"))


def test_a_flooding_tenant_evicts_its_own_prefixes_not_a_quiet_tenants(
        make_tiny_engine) -> None:
    """A quiet tenant caches one 4-block prompt; another sends 30 different 4-block
    prompts through a 24-block pool (so the cache must evict, again and again): the
    quiet tenant's follow-up still finds its whole prompt cached (plain LRU would have
    evicted it first, being the oldest), and the flood's last prompt is cached too."""
    engine = make_tiny_engine(num_kv_blocks=24)
    quiet = list(range(100, 100 + 4 * 16 + 1))
    _run(engine, quiet, "quiet")
    for i in range(30):
        _run(engine, list(range(1000 + 100 * i, 1000 + 100 * i + 4 * 16 + 1)), "flood")
    assert engine.kv.prefix.held_by(engine.intake.salt_for("flood")) > 4
    assert engine.metrics()["tenants"]["quiet"]["cached_blocks"] == 4
    assert _run(engine, quiet, "quiet").cached_tokens == 4 * 16
    last = list(range(1000 + 100 * 29, 1000 + 100 * 29 + 4 * 16 + 1))
    assert _run(engine, last, "flood").cached_tokens == 4 * 16
    engine.kv.check_no_leaks()


def test_a_tenants_running_limit_makes_its_requests_wait_not_anyone_elses(
        make_tiny_engine) -> None:
    """max_running=1 for tenant "a" (max_num_seqs 4): of its three requests one runs at
    a time, while tenant "b"'s two run beside it at once; every request finishes."""
    from ember.config import TenantLimits

    engine = make_tiny_engine(tenant_limits={"a": TenantLimits(max_running=1)},
                              max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [engine.add_request(list(range(100 + 10 * i, 130 + 10 * i)), params, tenant=t)
            for i, t in enumerate("aabab")]
    most = {"a": 0, "b": 0}
    while engine.has_unfinished():
        engine.step()
        for t in most:
            most[t] = max(most[t], sum(r.tenant == t for r in engine.scheduler.running))
    assert most == {"a": 1, "b": 2}
    assert all(len(r.output_ids) == 8 for r in reqs)
    engine.kv.check_no_leaks()


def test_a_tenants_queue_limit_refuses_its_requests_naming_its_own_limit(
        make_tiny_engine, monkeypatch) -> None:
    """max_queued=2 for every tenant ("*"): tenant "a"'s third waiting request is
    refused with a message naming a's limit; tenant "b" still gets in."""
    from ember.config import TenantLimits
    from ember.engine.admission import TenantQueueFull
    from ember.engine.thread import EngineThread

    engine = make_tiny_engine(tenant_limits={"*": TenantLimits(max_queued=2)})
    # one of a's requests already waits in the scheduler: it counts with the slots
    engine.add_request(list(range(100, 140)), GREEDY, tenant="a")
    monkeypatch.setattr(EngineThread, "alive", property(lambda self: True))
    thread = EngineThread(engine)  # not started: nothing leaves the queue meanwhile
    first = thread.slot("a")
    with pytest.raises(TenantQueueFull, match=r"tenant 'a' has 2 requests queued.*max_queued=2"):
        thread.slot("a")
    other = [thread.slot("b"), thread.slot("b")]  # b's own two
    first.release()
    again = thread.slot("a")  # a freed place is the tenant's again
    for s in (*other, again):
        s.release()
    assert thread._places.count == 0 and not any(thread._places.per_tenant().values())


def test_the_tenant_limits_file_names_what_it_refuses(tmp_path) -> None:
    from ember.config import TenantLimits
    from ember.errors import EmberError
    from ember.server.config import load_tenant_limits

    f = tmp_path / "limits.txt"
    f.write_text("# limits\ntenant-a max_running=2 max_queued=8 kv_share=0.25\n\n"
                 "* max_queued=16 disk_share=.5 max_adapters=2  # rest\n")
    assert load_tenant_limits(f) == {
        "tenant-a": TenantLimits(2, 8, kv_share=0.25),
        "*": TenantLimits(None, 16, disk_share=0.5, max_adapters=2)}
    for bad in ("t max_running=0", "t max_running=x", "t burst=3", "t max_queued",
                "t kv_share=0", "t kv_share=1.5", "t disk_share=x", "t max_adapters=0.5"):
        f.write_text(f"ok max_queued=1\n{bad}\n")
        with pytest.raises(EmberError, match=r"limits.txt:2"):
            load_tenant_limits(f)


def _share_run(engine, prompts: dict[str, list[list[int]]], params: SamplingParams
               ) -> tuple[dict[str, int], list]:
    """Run every tenant's prompts together; the most KV blocks each tenant's running
    requests held at once, and the requests."""
    reqs = [engine.add_request(p, params, tenant=t) for t, ps in prompts.items() for p in ps]
    most = dict.fromkeys(prompts, 0)
    while engine.has_unfinished():
        engine.step()
        for t in most:
            most[t] = max(most[t], sum(len(r.block_table.blocks)
                                       for r in engine.scheduler.running if r.tenant == t))
    return most, reqs


def test_a_tenants_kv_share_bounds_the_blocks_its_requests_hold(make_tiny_engine) -> None:
    """kv_share=0.25 of a 32-block pool for tenant "a": its four 3-block requests never
    hold more than 8 blocks at once (the rest wait, then run), while tenant "b", without
    a share, holds more; every request finishes with all its tokens."""
    from ember.config import TenantLimits

    engine = make_tiny_engine(num_kv_blocks=32, max_num_seqs=8,
                              tenant_limits={"a": TenantLimits(kv_share=0.25)})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = {t: [list(range(100 + 40 * i + k, 136 + 40 * i + k)) for i in range(4)]
               for k, t in ((0, "a"), (7, "b"))}
    most, reqs = _share_run(engine, prompts, params)
    assert 0 < most["a"] <= 8 < most["b"]
    assert all(len(r.output_ids) == 10 for r in reqs)
    engine.kv.check_no_leaks()


def test_a_request_beyond_its_tenants_kv_share_is_refused_or_stopped(make_tiny_engine) -> None:
    """A request that could never fit in its tenant's share (prompt + max_tokens) is
    refused naming the limit and max_tokens; one without max_tokens stops at the share
    with finish reason "length", as at the end of the context window."""
    from ember.config import TenantLimits
    from ember.engine.intake import InvalidRequest

    engine = make_tiny_engine(num_kv_blocks=32, tenant_limits={"a": TenantLimits(kv_share=0.25)})
    prompt = list(range(100, 140))
    with pytest.raises(InvalidRequest, match=r"kv_share=0.25.*8 blocks, 128 tokens") as e:
        engine.add_request(prompt, SamplingParams(max_tokens=100), tenant="a")
    assert e.value.param == "max_tokens"
    engine.add_request(prompt, SamplingParams(max_tokens=100), tenant="b")  # no share: fits
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=None,
                                                    ignore_eos=True),
                             tenant="a")
    while engine.has_unfinished():
        engine.step()
    assert len(req.token_ids) == 8 * 16 and req.finish_reason == "length"
    engine.kv.check_no_leaks()


def test_a_tenants_kv_share_caps_its_cached_prefixes(make_tiny_engine) -> None:
    """kv_share=0.25 of a 64-block pool: the flooding tenant's twenty 4-block prompts
    leave it at most 16 cached blocks though the pool never runs short; the quiet
    tenant's prompt stays cached and its follow-up is served from the cache."""
    from ember.config import TenantLimits

    engine = make_tiny_engine(num_kv_blocks=64,
                              tenant_limits={"flood": TenantLimits(kv_share=0.25)})
    quiet = list(range(100, 100 + 4 * 16 + 1))
    _run(engine, quiet, "quiet")
    for i in range(20):
        _run(engine, list(range(1000 + 100 * i, 1000 + 100 * i + 4 * 16 + 1)), "flood")
    held = engine.kv.prefix.held_by(engine.intake.salt_for("flood"))
    assert 12 <= held <= 16 and engine.kv.num_free > 0
    assert _run(engine, quiet, "quiet").cached_tokens == 4 * 16
    engine.kv.check_no_leaks()


def _record(i: int, salt: bytes):
    from ember.kv.disk import BlockRecord

    return BlockRecord(bytes([i]) * 16, bytes(16), salt, (i,), bytes([i]) * 1000)


def test_the_disk_tier_evicts_the_heaviest_tenant_first_and_keeps_its_share(tmp_path) -> None:
    """A 10-block disk tier: a quiet tenant's two blocks survive another tenant writing
    thirty (plain LRU deleted them first); with disk_share 0.3 the flood keeps at most
    three blocks' bytes even with room to spare; a restart reads back who owns what."""
    from ember.kv.disk import DiskStore, encode

    fp = b"f" * 32
    size = len(encode(fp, _record(0, b"quiet")))

    def store(cap=lambda scope: None, capacity: int = 10) -> DiskStore:
        return DiskStore(tmp_path / "kv", fp, capacity * size, scope_of=lambda s: s, cap=cap)

    s = store()
    for i in (1, 2):
        s.put(_record(i, b"quiet"))
    s.flush()
    for i in range(10, 40):
        s.put(_record(i, b"flood"))
        s.flush()
    assert bytes([1]) * 16 in s and bytes([2]) * 16 in s and len(s) == 10
    assert s.bytes_by_scope() == {b"quiet": 2 * size, b"flood": 8 * size}
    s.close()
    s = store(cap=lambda scope: 3 * size if scope == b"flood" else None, capacity=100)
    assert s.bytes_by_scope() == {b"quiet": 2 * size, b"flood": 3 * size}
    for i in range(40, 50):
        s.put(_record(i, b"flood"))
        s.flush()
    assert s.bytes_by_scope() == {b"quiet": 2 * size, b"flood": 3 * size}
    assert bytes([49]) * 16 in s and bytes([40]) * 16 not in s
    s.close()


def test_when_the_pool_runs_out_the_tenant_over_its_share_is_preempted_first(
        make_tiny_engine, monkeypatch) -> None:
    """A 16-block pool: tenant "big" runs three growing requests, tenant "small" one
    admitted after them. When the pool runs out, the requests preempted are big's (it
    holds more than half), never small's, though small's is the newest; all finish."""
    engine = make_tiny_engine(num_kv_blocks=16, max_num_seqs=8, enable_prefix_caching=False)
    victims: list[str] = []
    preempt = engine.scheduler._preempt

    def recorded(req, out):
        victims.append(req.tenant)
        preempt(req, out)

    monkeypatch.setattr(engine.scheduler, "_preempt", recorded)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    reqs = [engine.add_request(list(range(100 + 50 * i, 140 + 50 * i)), params, tenant="big")
            for i in range(3)]
    for _ in range(3):
        engine.step()
    reqs.append(engine.add_request(list(range(900, 920)), params, tenant="small"))
    while engine.has_unfinished():
        engine.step()
    assert victims and set(victims) == {"big"}
    assert all(len(r.output_ids) == 60 for r in reqs)
    engine.kv.check_no_leaks()


def test_another_tenants_cached_prompt_is_computed_whole_by_a_prober(
        make_tiny_engine, tmp_path) -> None:
    """Why tenant B cannot time tenant A's cache (the timing AUC itself is measured by
    ``ember bench isolation``): with quotas on, and through an adapter, B's request for
    a prompt A cached hits nothing (``cached_tokens == 0``) and the runner computes all
    of its positions — exactly what it computes for a fresh prompt; A's own repeat hits
    (the positive control)."""
    from ember.bench.lora import write_random_adapter
    from ember.config import TenantLimits

    engine = make_tiny_engine(num_kv_blocks=512, tenant_limits={"*": TenantLimits(
        kv_share=0.25, max_adapters=1)})
    adapter = write_random_adapter(engine.loaded.config, 4, 1, tmp_path / "a.gguf")
    engine.load_lora("a", str(adapter))
    computed: dict[str, int] = {}
    execute = engine.runner.execute

    def counted(rows):
        for row in rows:
            rid = row.request.request_id
            computed[rid] = computed.get(rid, 0) + row.num_tokens
        return execute(rows)

    engine.runner.execute = counted
    params = SamplingParams(temperature=0, max_tokens=1)

    def run(prompt: list[int], tenant: str, lora: str | None) -> tuple[int, int]:
        req = engine.add_request(prompt, params, tenant=tenant, lora=lora)
        while engine.has_unfinished():
            engine.step()
        return req.cached_tokens, computed[req.request_id]

    for lora in (None, "a"):
        secret = [100 + (37 * i + (7 if lora else 0)) % 3900 for i in range(192)]
        fresh = [100 + (53 * i + (7 if lora else 0)) % 3900 for i in range(192)]
        run(secret, "a", lora)
        assert run(secret, "b", lora) == (0, 192) == run(fresh, "b", lora)
        hit, ran = run(secret, "a", lora)  # the control: A's own cache answers A
        assert hit >= 176 and ran == 192 - hit
    engine.kv.check_no_leaks()
