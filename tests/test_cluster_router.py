"""The replica router's policy and the front's prefix keys, without Ray.

The keys' oracle is the engine itself: after serving a prompt, its own prefix cache
must hold exactly the keys the front predicted for that tenant, and none of another
tenant's.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from ember.cluster.front import FrontEngine
from ember.cluster.metrics import merge_into as _add
from ember.cluster.router import ROUTED_TTL, RoutingView, choose
from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.models.loader import load_model_meta
from ember.sampling.params import SamplingParams


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def view_with(digests: dict[str, list[bytes]], loads: dict[str, int]) -> RoutingView:
    v = RoutingView()
    for replica, held in digests.items():
        v.observe(replica, {"keys": held, "taken_at": time.time()})
    for replica, n in loads.items():
        v.inflight[replica] = n
    return v


def test_the_replica_with_the_longest_cached_prefix_wins() -> None:
    prompt = keys("k", 6)
    v = view_with({"a": prompt[:2], "b": prompt[:5], "c": []}, {"a": 0, "b": 1, "c": 0})
    d = choose(prompt, ["a", "b", "c"], v, imbalance=4)
    assert (d.replica, d.by, d.blocks) == ("b", "affinity", 5)


def test_a_prefix_counts_only_from_its_first_block() -> None:
    prompt = keys("k", 4)
    v = view_with({"a": prompt[1:], "b": prompt[:3]}, {})
    assert choose(prompt, ["a", "b"], v, imbalance=4).replica == "b"


def test_a_short_shared_prefix_does_not_pin_new_conversations() -> None:
    """A tenant's system prompt (2 of 8 blocks here) is on replica a: new conversations
    still spread by load, preferring a only as a tie-break."""
    prompt = keys("k", 8)
    v = view_with({"a": prompt[:2]}, {"a": 3, "b": 1})
    for seed in range(10):
        d = choose(prompt, ["a", "b"], v, imbalance=4, rng=random.Random(seed))
        assert (d.replica, d.by) == ("b", "load")
    v.inflight["b"] = 3  # equal loads: the match breaks the tie
    assert choose(prompt, ["a", "b"], v, imbalance=4).replica == "a"


def test_an_overloaded_holder_falls_back_to_the_least_loaded() -> None:
    prompt = keys("k", 4)
    v = view_with({"a": prompt}, {"a": 9, "b": 2, "c": 3})
    d = choose(prompt, ["a", "b", "c"], v, imbalance=4, rng=random.Random(0))
    assert d.by == "load" and d.replica in ("b", "c")
    # within the threshold the holder keeps it
    v.inflight["a"] = 6
    assert choose(prompt, ["a", "b", "c"], v, imbalance=4).replica == "a"


def test_power_of_two_choices_picks_the_less_loaded_of_its_pair() -> None:
    """Four replicas of loads 0 < 1 < 2 < 3: a random pair's lighter one is the
    lightest of all with probability 1/2, the next 1/3, the third 1/6 — so, unlike
    least-loaded, the third is sometimes chosen — and the heaviest never is."""
    v = view_with({}, {"a": 0, "b": 1, "c": 2, "d": 3})
    picks = Counter()
    for seed in range(600):
        d = choose(keys("k", 3), ["a", "b", "c", "d"], v, imbalance=4,
                   rng=random.Random(seed))
        assert (d.by, d.blocks) == ("load", 0)
        picks[d.replica] += 1
    assert picks["d"] == 0
    for replica, share in (("a", 1 / 2), ("b", 1 / 3), ("c", 1 / 6)):
        assert abs(picks[replica] / 600 - share) < 0.06, picks


def test_routed_keys_count_until_their_ttl() -> None:
    prompt = keys("k", 3)
    v = RoutingView()
    v.routed_to("a", prompt)
    now = time.monotonic()
    assert v.match("a", prompt, now) == 3
    assert v.match("a", prompt, now + ROUTED_TTL + 1) == 0
    v.forget("a")
    assert v.match("a", prompt, now) == 0


def test_metrics_of_replicas_add_up() -> None:
    total: dict = {}
    _add(total, {"requests_running": 2, "tenants": {"t": {"running": 1}}, "moe": None,
                 "spec": {"sources": {"ngram": [4, 3]}, "bonus": 1}})
    _add(total, {"requests_running": 3, "tenants": {"t": {"running": 2}}, "moe": None,
                 "spec": {"sources": {"ngram": [1, 1]}, "bonus": 2}})
    assert total == {"requests_running": 5, "tenants": {"t": {"running": 3}}, "moe": None,
                     "spec": {"sources": {"ngram": [5, 4]}, "bonus": 3}}


@pytest.mark.parametrize("tenant", ["tenant-a", None])
def test_front_keys_are_the_engines_own_cache_keys_for_that_tenant(tiny_gguf, tenant) -> None:
    config = EngineConfig(model=str(tiny_gguf), weights="f32", num_kv_blocks=64,
                          speculation="off")
    engine = LLMEngine(config)
    front = FrontEngine(config, load_model_meta(str(tiny_gguf), "f32"), replicas=None)
    assert front.model_salt == engine.intake.model_salt
    prompt = list(range(100, 100 + 5 * config.block_size + 3))  # 5 full blocks
    _run(engine, prompt, tenant)
    cached = set(engine.kv.prefix.keys())
    mine = front.prefix_keys(prompt, tenant)
    other = front.prefix_keys(prompt, "someone-else")
    assert len(mine) == 5 and set(mine) <= cached
    assert not set(other) & cached
    assert front.prefix_keys([-1, 2], tenant) == []  # not token ids: the replica says so


def _run(engine: LLMEngine, prompt: list[int], tenant: str | None) -> None:
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), tenant=tenant)
    while engine.has_unfinished():
        engine.step()
    assert req.output_ids


def test_replicas_that_refused_a_request_are_not_chosen_again_unless_all_did() -> None:
    from ember.cluster.protocol import GroupSpec
    from ember.cluster.router import eligible

    spec = GroupSpec("g", [1], [SamplingParams()], "t", avoid=("a",))
    assert eligible(spec, ["a", "b", "c"]) == ["b", "c"]
    spec.avoid = ("a", "b", "c")
    assert eligible(spec, ["a", "b", "c"]) == ["a", "b", "c"]
    assert eligible(None, ["a"]) == ["a"]
