"""LoRA adapters behind ``--replicas``: the front checks an adapter and records its
identity, a request carries (name, path, identity) to whichever replica serves it, and
the replica loads the same file on demand — refusing it if the file changed. Driven
without Ray: the front's ``FrontEngine`` and a replica's ``EmberReplica`` directly (the
e2e test in tests/e2e/test_replicas.py runs them on Ray Serve)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from ember.bench.lora import write_random_adapter
from ember.cluster import wire
from ember.cluster.front import FrontEngine
from ember.cluster.protocol import GroupSpec, Verdict
from ember.cluster.replica import EmberReplica
from ember.config import EngineConfig
from ember.engine.intake import InvalidRequest
from ember.models.loader import load_model_meta
from ember.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(100, 100 + 40))


@pytest.fixture(scope="module")
def setup(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    config = EngineConfig(model=str(tiny_gguf), weights="f32", num_kv_blocks=64,
                          speculation="off")
    meta = load_model_meta(str(tiny_gguf), "f32")
    root = tmp_path_factory.mktemp("adapters")
    paths = [write_random_adapter(meta.config, 4, seed, root / f"a{seed}.gguf", std=0.3)
             for seed in (1, 2)]
    return config, meta, paths


def _generate(replica: EmberReplica, spec: GroupSpec) -> tuple[Verdict, list[int]]:
    async def run() -> tuple[Verdict, list[int]]:
        verdict, tokens = None, []
        async for message in replica.generate(*wire.call_args(spec)):
            item = wire.read_item(message)
            if isinstance(item, Verdict):
                verdict = item
            elif item.finished:
                tokens = list(item.token_ids)
        return verdict, tokens

    return asyncio.run(run())


def test_the_front_routes_an_adapters_prefix_apart_and_refuses_unknown_names(setup) -> None:
    config, meta, (a1, a2) = setup
    front = FrontEngine(config, meta, replicas=None)
    adapter = front.load_lora("one", str(a1))
    assert adapter.rank == 4 and front.loras["one"] == (str(a1), adapter.identity)
    base = front.prefix_keys(PROMPT, "t")
    one = front.prefix_keys(PROMPT, "t", adapter.identity)
    assert len(base) == len(one) == 2 and not set(base) & set(one)
    with pytest.raises(InvalidRequest, match="'two'") as e:
        front.prepare(PROMPT, GREEDY, tenant="t", lora="two")
    assert e.value.param == "lora"
    front.unload_lora("one")
    with pytest.raises(InvalidRequest, match="'one'"):
        front.prepare(PROMPT, GREEDY, tenant="t", lora="one")


def test_a_replica_loads_what_the_front_checked_and_refuses_a_changed_file(
        setup, tmp_path) -> None:
    """The replica's tokens with the adapter are a single engine's with it; the front's
    predicted prefix keys are the ones the replica caches; a file swapped after the
    front loaded it is refused by the replica (its identity), naming the model."""
    import ember

    config, meta, (a1, a2) = setup
    path = tmp_path / "adapter.gguf"
    shutil.copy(a1, path)
    front = FrontEngine(config, meta, replicas=None)
    identity = front.load_lora("one", str(path)).identity
    replica = EmberReplica(config)
    try:
        spec = GroupSpec("r1", PROMPT, [GREEDY], tenant="t", lora=("one", str(path), identity))
        verdict, tokens = _generate(replica, spec)
        assert verdict.error is None, verdict
        llm = ember.LLM(str(config.model), weights="f32", num_kv_blocks=64, speculation="off",
                        loras={"one": str(a1)})
        assert tokens == list(llm.generate([PROMPT], GREEDY, lora="one")[0].token_ids)
        assert tokens != list(llm.generate([PROMPT], GREEDY)[0].token_ids)
        cached = set(replica.engine.kv.prefix.keys())
        assert set(front.prefix_keys(PROMPT, "t", identity)) <= cached
        assert not set(front.prefix_keys(PROMPT, "t")) & cached
        # the file changes under the same name: the replica has the old one resident,
        # but a request naming the new identity makes it read the file again
        shutil.copy(a2, path)
        stale = GroupSpec("r2", PROMPT, [GREEDY], tenant="t",
                          lora=("one", str(path), identity))
        replica.engine.loras.unload("one")  # evicted meanwhile: read again from the file
        verdict, tokens = _generate(replica, stale)
        assert verdict.kind == "invalid" and verdict.param == "model", verdict
        assert "changed since it was loaded" in verdict.error and tokens == []
        replica.engine.kv.check_no_leaks()
    finally:
        replica.thread.shutdown(timeout=10)
