"""Prefill/decode disaggregation: the rule of eq. 10.7, the planner's choices, and the
KV handoff between two real replicas (their engines are the oracle: a disaggregated
request must answer exactly as a co-located one)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from ember.cluster import wire
from ember.cluster.disagg import Planner, ReplicaLoad, Terms, decide, transfer_seconds
from ember.cluster.protocol import GroupSpec, Handoff, Verdict
from ember.cluster.replica import EmberReplica
from ember.config import EngineConfig
from ember.engine.costs import Coefficients, StepCostModel
from ember.engine.output import RequestOutput
from ember.sampling.params import SamplingParams

GIB = 1024**3
PROMPT = list(range(1000, 1101))  # 101 tokens: 6 full blocks of 16 before the last token
HANDED = 96


# ---------------------------------------------------------------- the rule
@pytest.mark.parametrize(("kv_gib", "saved_ms", "cost_ms", "split"),
                         [(0.25, 3.0, 4.05, False), (4.0, 35.0, 22.8, True)])
def test_the_rule_on_the_seeds_two_fixtures(kv_gib, saved_ms, cost_ms, split) -> None:
    """Seed chapter 10 §10.7: a short prompt saves 3 ms and pays 4.05 ms (stay), a long
    one saves 35 ms and pays 22.8 ms (split); 200 GiB/s and 2.8 ms of coordination."""
    terms = Terms(interference_saved=saved_ms / 1e3,
                  transfer=transfer_seconds(kv_gib * GIB, 200 * GIB), coordination=2.8e-3)
    assert terms.cost * 1e3 == pytest.approx(cost_ms)
    assert decide(terms) is split


def test_every_cost_term_counts_against_splitting() -> None:
    base = Terms(interference_saved=0.010, transfer=0.002, coordination=0.002)
    assert decide(base)
    for term in ("transfer", "coordination", "queue_imbalance", "failure"):
        assert not decide(Terms(**{**base.as_dict(), term: 0.011})), term
    assert decide(Terms(**{**base.as_dict(), "interference_saved": 0.0,
                           "specialization": 0.005}))


# ---------------------------------------------------------------- the planner
COSTS = Coefficients(base=0.004, per_token=0.0002, per_row=0.0005, per_attended=1e-8,
                     verify_call=0.0, per_logit=0.0, per_excess=0.0, per_draft=0.0, knee=32)


def _load(name: str, decoding: int = 0, backlog: int = 0,
          step_limit: float = math.inf) -> ReplicaLoad:
    return ReplicaLoad(name, decoding, backlog, 300, StepCostModel(COSTS, learn=False),
                       step_limit=step_limit)


def test_short_prompts_stay_and_long_ones_move_off_a_decoder_guarding_its_streams() -> None:
    """Streams with a 30 ms TPOT objective cap the decoder's steps: a long prompt there
    is computed in small chunks, on the idle replica in full ones."""
    planner = Planner()
    loads = {"d": _load("d", decoding=4, step_limit=0.027), "p": _load("p")}
    per_token = 20_000  # KV bytes per token
    short = planner.plan(loads, "d", 16, 0, 16 * per_token)
    long = planner.plan(loads, "d", 2000, 0, 2000 * per_token)
    assert short.prefill is None and short.terms is not None
    assert long.prefill == "p" and long.terms.gain > long.terms.cost
    assert long.terms.specialization > long.terms.cost  # its own first token comes sooner
    assert planner.decisions == {"colocated": 1, "disaggregated": 1}


def test_stream_stall_alone_does_not_move_a_prompt_whose_first_token_would_suffer() -> None:
    """Unguarded streams stall for the prefill (ΔI > costs) but the prompt would not be
    computed sooner elsewhere: the guard keeps it, where eq. 10.7 alone would move it."""
    loads = {"d": _load("d", decoding=8), "p": _load("p")}
    plan = Planner().plan(loads, "d", 2000, 0, 2000 * 20_000)
    assert plan.terms.gain > plan.terms.cost and plan.prefill is None
    assert Planner(policy="always").plan(loads, "d", 2000, 0, 10**6).prefill == "p"


def test_no_streams_to_spare_no_split_and_a_busy_prefill_replica_saves_nothing() -> None:
    planner = Planner()
    idle = planner.plan({"d": _load("d"), "p": _load("p")}, "d", 2000, 0, 40_000_000)
    assert idle.prefill is None and idle.terms.interference_saved == 0.0
    both = planner.plan({"d": _load("d", 8), "p": _load("p", 8)}, "d", 2000, 0, 40_000_000)
    assert both.prefill is None and both.terms.interference_saved < 0  # it moves, plus a load
    queued = planner.plan({"d": _load("d", 8), "p": _load("p", 0, backlog=20_000)}, "d",
                          2000, 0, 40_000_000)
    assert queued.prefill is None and queued.terms.queue_imbalance > 1.0


def test_the_pool_limits_who_prefills_and_measurements_reprice_the_transfer() -> None:
    loads = {"a": _load("a"), "b": _load("b", 8), "c": _load("c")}
    loads["b"] = _load("b", 8, step_limit=0.027)
    assert Planner(prefill_replicas=1).plan(loads, "b", 2000, 0, 10**6).prefill == "a"
    busy_a = {**loads, "a": _load("a", 8, step_limit=0.027)}
    assert Planner(prefill_replicas=1).plan(busy_a, "a", 2000, 0, 10**6).prefill is None
    assert Planner().plan(busy_a, "a", 2000, 0, 10**6).prefill == "c"
    planner = Planner()
    before = planner.plan(loads, "b", 2000, 0, 10**8).terms.transfer
    # one handoff measured at 50 MB/s, twenty times slower than the prior, outweighs it
    planner.observe(ok=True, kv_bytes=50_000_000, transfer_s=1.0, coordination_s=0.05)
    after = planner.plan(loads, "b", 2000, 0, 10**8)
    assert after.terms.transfer == pytest.approx(20 * before) and after.prefill is None
    assert planner.coordination == pytest.approx(0.05)
    planner.observe(ok=True, kv_bytes=150_000_000, transfer_s=1.0, coordination_s=0.05)
    assert planner.bandwidth == pytest.approx(100e6)  # the mean of the first two
    for _ in range(30):  # then an average that follows the link as it drifts
        planner.observe(ok=True, kv_bytes=10_000_000, transfer_s=1.0, coordination_s=0.05)
    assert planner.bandwidth == pytest.approx(10e6, rel=0.01)
    failing = Planner()
    for _ in range(50):
        failing.observe(ok=False)
    assert failing.plan(loads, "b", 2000, 0, 10**6).terms.failure > \
        Planner().plan(loads, "b", 2000, 0, 10**6).terms.failure * 10


# ---------------------------------------------------------------- the handoff
@pytest.fixture(scope="module")
def replicas(tiny_gguf: Path, tiny_loaded_q4):
    """Three replicas of the tiny model (q4): prefill, decode, and a reference that
    runs everything itself; plus one whose KV dtype differs."""
    def make(**options) -> EmberReplica:
        config = EngineConfig(model=str(tiny_gguf), weights="q4", threads=1,
                              num_kv_blocks=128, **options)
        return EmberReplica(config, tiny_loaded_q4)

    made = {"prefill": make(), "decode": make(), "reference": make(),
            "f32kv": make(kv_dtype="f32")}
    yield made
    for r in made.values():
        r.thread.shutdown(timeout=5)


def _spec(request_id: str, tenant: str = "a", **kw) -> GroupSpec:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    return GroupSpec(request_id, list(PROMPT), [params], tenant, **kw)


def _run(replica: EmberReplica, spec: GroupSpec) -> list:
    async def collect() -> list:
        return [wire.read_item(item)
                async for item in replica.generate(*wire.call_args(spec))]

    return asyncio.run(collect())


def _answer(items: list) -> tuple[list[int], list, int]:
    last = [i for i in items if isinstance(i, RequestOutput)][-1]
    assert last.finished and last.finish_reason == "length"
    return last.token_ids, [(lp.token, lp.logprob, lp.top) for lp in last.logprobs], \
        last.cached_tokens


def _handoff(replicas, rid: str, tenant: str = "a", first: int = 0) -> Handoff:
    items = _run(replicas["prefill"], _spec(rid, tenant, prefill=True, handoff_from=first))
    verdict, handoff = items
    assert isinstance(verdict, Verdict) and verdict.error is None
    assert isinstance(handoff, Handoff) and not handoff.error
    assert handoff.tokens == HANDED and handoff.nbytes > 0
    if not isinstance(handoff.blocks, list):  # published in Ray's object store
        import ray

        handoff.blocks = ray.get(handoff.blocks)
    return handoff


def _purge(*rs: EmberReplica) -> None:
    for r in rs:
        for tenant in ("a", "b"):
            r.thread.purge_cache(tenant)


def test_a_handed_over_prompt_answers_exactly_as_a_colocated_one(replicas) -> None:
    _purge(*replicas.values())
    reference = _answer(_run(replicas["reference"], _spec("ref")))
    handoff = _handoff(replicas, "h1")
    items = _run(replicas["decode"], _spec("h1", handoff=handoff))
    report = items[0].imported
    assert report["tokens"] == report["loaded"] == HANDED and not report["error"]
    tokens, logprobs, cached = _answer(items)
    assert cached == HANDED  # its prompt came from the handoff, not recomputed
    assert (tokens, logprobs) == reference[:2]  # q4: bitwise
    # the same prompt handed over again: every block is cached there already
    again = _run(replicas["decode"], _spec("h2", handoff=handoff))[0].imported
    assert again["tokens"] == HANDED and again["loaded"] == 0


def test_blocks_the_decoder_holds_are_not_handed_over_again(replicas) -> None:
    _purge(*replicas.values())
    reference = _answer(_run(replicas["reference"], _spec("ref")))
    decoder = replicas["decode"]
    spec = _spec("head")
    spec.prompt_ids = PROMPT[:40]  # the decoder computes the prompt's first 2 blocks
    _run(decoder, spec)
    whole = _handoff(replicas, "all")
    handoff = _handoff(replicas, "skip", first=2)
    assert handoff.first == 2 and len(handoff.blocks) == HANDED // 16 - 2
    assert handoff.nbytes == whole.nbytes * (HANDED // 16 - 2) // (HANDED // 16)
    items = _run(decoder, _spec("skip", handoff=handoff))
    report = items[0].imported
    assert report["tokens"] == HANDED and report["loaded"] == HANDED - 32
    assert not report["error"]
    tokens, logprobs, cached = _answer(items)
    assert cached == HANDED and (tokens, logprobs) == reference[:2]
    # the same handoff to a decoder that lost those 2 blocks: nothing is taken, the
    # whole prompt is recomputed, and the answer is the same
    _purge(decoder)
    items = _run(decoder, _spec("lost", handoff=handoff))
    assert items[0].imported["tokens"] == 0 and "no longer cached" in items[0].imported["error"]
    tokens, logprobs, cached = _answer(items)
    assert cached == 0 and (tokens, logprobs) == reference[:2]


@pytest.mark.parametrize("damage", ["corrupt", "tenant", "layout"])
def test_a_bad_block_is_refused_and_its_tokens_recomputed(replicas, damage) -> None:
    _purge(*replicas.values())
    oracle = replicas["f32kv" if damage == "layout" else "reference"]
    reference = _answer(_run(oracle, _spec("ref")))
    _purge(oracle)
    handoff = _handoff(replicas, f"bad-{damage}")
    decoder, tenant = replicas["decode"], "a"
    if damage == "corrupt":  # one byte of block 2's payload flipped in transit
        block = bytearray(handoff.blocks[2])
        block[len(block) // 2] ^= 0x40
        handoff.blocks[2] = bytes(block)
    elif damage == "tenant":  # tenant a's KV offered to tenant b's request
        tenant = "b"
    else:  # computed for f16 KV, offered to a replica holding f32
        decoder = replicas["f32kv"]
    items = _run(decoder, _spec(f"bad-{damage}", tenant, handoff=handoff))
    report = items[0].imported
    taken = {"corrupt": 32, "tenant": 0, "layout": 0}[damage]
    assert report["tokens"] == taken and report["error"], report
    tokens, logprobs, cached = _answer(items)
    assert cached == taken
    assert (tokens, logprobs) == reference[:2]


def test_a_prefill_that_is_cancelled_releases_its_blocks(replicas) -> None:
    _purge(*replicas.values())
    prefill = replicas["prefill"]
    spec = _spec("gone", prefill=True)
    spec.prompt_ids = list(range(1000, 1000 + 1500))

    async def leave_after_the_verdict() -> None:
        stream = prefill.generate(*wire.call_args(spec))
        assert wire.read_item(await anext(stream)).error is None
        await stream.aclose()  # the front's client left during the prefill

    asyncio.run(leave_after_the_verdict())

    def idle(e) -> bool:  # read on the engine thread: between steps, never inside one
        return not e.scheduler.running and not e.scheduler.waiting

    for _ in range(200):
        if prefill.thread.call(idle):
            break
        time.sleep(0.01)
    assert prefill.thread.call(idle)
    assert prefill.thread.call(lambda e: e.kv.num_used) == 0
    prefill.thread.call(lambda e: e.kv.check_no_leaks())


def test_the_prefill_half_leaves_the_tpot_objective_to_the_decoder(replicas) -> None:
    """A replica that only prefills has never timed a decode step: its step costs may
    price one past any objective. The prefill half is checked for everything else."""
    from ember.engine.intake import SLO

    _purge(*replicas.values())
    scheduler = replicas["prefill"].engine.scheduler
    kept = scheduler.costs
    scheduler.costs = StepCostModel(Coefficients(base=1.0), learn=False)  # 1 s a step
    try:
        verdict, handoff = _run(replicas["prefill"], _spec("slo", prefill=True,
                                                           slo=SLO(None, 0.15)))
    finally:
        scheduler.costs = kept
    assert verdict.error is None and not handoff.error and handoff.tokens == HANDED


def test_an_invalid_request_is_refused_by_the_prefill_replica_as_by_any(replicas) -> None:
    bad = _spec("bad", prefill=True)
    bad.params = [SamplingParams(max_tokens=10**6, temperature=0.0)]
    (verdict,) = _run(replicas["prefill"], bad)
    assert verdict.kind == "invalid" and verdict.param == "max_tokens"
