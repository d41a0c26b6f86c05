"""LoRA adapters over the real SmolLM2, against oracles that are not ember's.

The adapter is a PEFT LoRA (rank 4 on all seven projections, random A and B) on
transformers' own SmolLM2 (dequantized from the same GGUF): transformers + PEFT is the
logits oracle for ember loading the PEFT directory, and llama.cpp's
``convert_lora_to_gguf.py`` turns the same directory into a GGUF adapter, which must
give ember the same logits (so ember's q/k row permutation of a PEFT adapter is
llama.cpp's). Then the engine: adapters and the base in one batch, each request as
alone; no prefix shared across adapters; refusals that name what does not fit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lora_adapters import IDS

from ember.models.loader import load_model
from ember.models.lora import LoRAError, load_lora
from ember.sampling.params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(smollm2_adapters):
    return smollm2_adapters


@pytest.fixture(scope="module")
def base_f32(smollm2_gguf: Path):
    return load_model(str(smollm2_gguf), "f32")


def test_peft_adapter_gives_transformers_logits(adapters, base_f32) -> None:
    adapter = load_lora(adapters["peft"], "peft", base_f32.config)
    assert adapter.rank == 4 and len(adapter.deltas) == 7 * base_f32.config.n_layers
    ours = base_f32.model.score(IDS, lora=adapter)
    base = base_f32.model.score(IDS)
    err = (ours - adapters["oracle"]).abs().max().item()
    moved = (base - adapters["oracle"]).abs().max().item()
    print(f"PEFT adapter: max |Δlogit| vs transformers+PEFT {err:.1e} (base vs it {moved:.1f})")
    assert moved > 1.0  # the adapter changes the model visibly
    assert err < 2e-3
    assert torch.equal(ours.argmax(-1), adapters["oracle"].argmax(-1))


def test_gguf_adapter_from_llama_cpps_converter_equals_the_peft_one(adapters, base_f32) -> None:
    """The converter permutes q and k rows for llama's RoPE layout, as ember does to a
    PEFT adapter: both files give the same logits."""
    gguf = load_lora(adapters["gguf"], "gguf", base_f32.config)
    peft = load_lora(adapters["peft"], "peft", base_f32.config)
    assert gguf.deltas.keys() == peft.deltas.keys()
    a = base_f32.model.score(IDS, lora=gguf)
    b = base_f32.model.score(IDS, lora=peft)
    assert (a - b).abs().max().item() < 1e-4


def test_embers_peft_to_gguf_writes_what_llama_cpps_converter_writes(
        adapters, base_f32, tmp_path) -> None:
    from ember.models.gguf import GGUFFile
    from ember.models.linear import load_dense
    from ember.models.lora import peft_to_gguf

    ours = GGUFFile(peft_to_gguf(adapters["peft"], base_f32.config, tmp_path / "ours.gguf"))
    theirs = GGUFFile(adapters["gguf"])
    for key in ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha"):
        assert ours.metadata[key] == theirs.metadata[key], key
    assert set(ours.tensors) == set(theirs.tensors)
    for name in theirs.tensors:
        assert torch.equal(load_dense(ours, name), load_dense(theirs, name)), name


def test_a_zero_adapter_is_the_base_bitwise(adapters, base_f32) -> None:
    zero = load_lora(adapters["zero"], "zero", base_f32.config)
    assert torch.equal(base_f32.model.score(IDS, lora=zero), base_f32.model.score(IDS))


def test_mixed_adapters_in_one_batch_equal_each_alone(adapters, smollm2_gguf, base_f32) -> None:
    """The base and two adapters, four requests in one batch (and forked siblings):
    each gives the tokens it gives alone; no prefix is shared across adapters."""
    import ember

    llm = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=128,
                    loras={"peft": adapters["peft"], "gguf": adapters["gguf"]})
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Water boils at"]
    loras = [None, "peft", "gguf", "peft"]
    alone = [llm.generate([p], greedy, lora=lr)[0] for p, lr in zip(prompts, loras, strict=True)]
    assert alone[1].token_ids != llm.generate([prompts[1]], greedy)[0].token_ids
    engine = llm.engine
    reqs = [engine.add_request(llm.encode(p), greedy, lora=lr)
            for p, lr in zip(prompts, loras, strict=True)]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == [list(o.token_ids) for o in alone]
    # a prompt cached for the base is not reused for an adapter, nor across adapters
    prompt = llm.encode("A long shared preamble about the weather in several cities, " * 3)
    first = engine.add_request(prompt, greedy)
    while engine.has_unfinished():
        engine.step()
    for lora, cached in (("peft", 0), ("gguf", 0), ("peft", 1)):
        req = engine.add_request(prompt, greedy, lora=lora)
        while engine.has_unfinished():
            engine.step()
        assert (req.cached_tokens > 0) == bool(cached), (lora, req.cached_tokens)
    assert first.cached_tokens == 0
    engine.kv.check_no_leaks()


def test_unknown_adapter_and_unload(adapters, smollm2_gguf) -> None:
    import ember
    from ember.engine.intake import InvalidRequest

    llm = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=64,
                    loras={"peft": adapters["peft"]})
    with pytest.raises(InvalidRequest, match="'nope'") as e:
        llm.generate(["Hi"], SamplingParams(max_tokens=2), lora="nope")
    assert e.value.param == "lora"
    llm.unload_lora("peft")
    with pytest.raises(InvalidRequest, match="'peft'"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2), lora="peft")


def test_resident_adapters_are_bounded_and_reloaded_from_their_files(
        adapters, smollm2_gguf, tmp_path) -> None:
    """--max-loras 1: loading a second adapter evicts the first; a request for it reads
    it again (same tokens as before), and a file changed meanwhile is refused."""
    import ember
    from ember.engine.intake import InvalidRequest

    copy = tmp_path / "copy"
    shutil.copytree(adapters["peft"], copy)
    llm = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=64, max_loras=1,
                    loras={"peft": copy})
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = llm.generate(["Once upon a time"], greedy, lora="peft")[0].token_ids
    llm.load_lora("gguf", adapters["gguf"])  # evicts "peft"
    stats = llm.engine.loras.metrics()
    assert stats["resident"] == 1 and stats["adapters"]["peft"]["evictions"] == 1
    assert llm.generate(["Once upon a time"], greedy, lora="peft")[0].token_ids == before
    stats = llm.engine.loras.metrics()["adapters"]
    assert stats["peft"]["loads"] == 2 and stats["gguf"]["evictions"] == 1
    assert stats["peft"]["requests"] == 2 and stats["peft"]["tokens"] == 12
    llm.load_lora("gguf", adapters["gguf"])  # evicts "peft" again
    shutil.copy(adapters["zero"] / "adapter_model.safetensors", copy)
    with pytest.raises(InvalidRequest, match="changed since it was loaded"):
        llm.generate(["Hi"], greedy, lora="peft")


def test_adapters_that_do_not_fit_are_refused_naming_why(adapters, base_f32, tmp_path) -> None:
    cfg = base_f32.config
    with pytest.raises(LoRAError, match="rank 4 is above max_lora_rank 2"):
        load_lora(adapters["peft"], "x", cfg, max_rank=2)
    # another base: the same adapter against a model with another hidden size
    with pytest.raises(LoRAError, match="do not fit the base projection"):
        load_lora(adapters["peft"], "x", dataclasses.replace(cfg, hidden_size=cfg.hidden_size * 2))
    with pytest.raises(LoRAError, match="architecture 'llama'.*'qwen2'"):
        load_lora(adapters["gguf"], "x", dataclasses.replace(cfg, architecture="qwen2"))
    # a module ember does not map (the output head)
    bad = tmp_path / "head"
    shutil.copytree(adapters["peft"], bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in tensors if ".q_proj.lora_A." in k)
    other = key.replace("q_proj", "rotary_thing")
    tensors[other] = tensors[key].clone()
    tensors[other.replace("lora_A", "lora_B")] = tensors[key.replace("lora_A", "lora_B")].clone()
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="'rotary_thing'"):
        load_lora(bad, "x", cfg)
    # a truncated safetensors file, and a directory without the config
    (bad / "adapter_model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(LoRAError, match="not a safetensors file"):
        load_lora(bad, "x", cfg)
    (bad / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match="adapter_config.json"):
        load_lora(bad, "x", cfg)


LLAMA_PYTHON = os.environ.get("EMBER_LLAMA_PYTHON")


@pytest.mark.skipif(not LLAMA_PYTHON, reason="set EMBER_LLAMA_PYTHON to an interpreter "
                    "with llama-cpp-python to compare with llama.cpp")
def test_llama_cpp_with_the_same_gguf_adapter_picks_the_same_tokens(
        adapters, smollm2_gguf, base_f32, tmp_path) -> None:
    """llama.cpp runs the Q4_1 base with int8 activations, ember here dequantized f32:
    the top token agrees wherever ember's top two are not a near-tie."""
    import numpy as np

    out = tmp_path / "logits.npy"
    subprocess.run([str(LLAMA_PYTHON), str(Path(__file__).with_name("llamacpp_logits.py")),
                    str(smollm2_gguf), str(out), ",".join(map(str, IDS)),
                    str(adapters["gguf"])], check=True)
    theirs = torch.from_numpy(np.load(out))
    ours = base_f32.model.score(IDS, lora=load_lora(adapters["gguf"], "g", base_f32.config))
    top2 = ours.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    agree = ours.argmax(-1) == theirs.argmax(-1)
    print(f"llama.cpp + adapter: top token agrees at {int(agree.sum())}/{len(IDS)} "
          f"positions, max |Δlogit| {(ours - theirs).abs().max():.2f}")
    assert bool(agree[clear].all())
    # llama.cpp applied the adapter: nearer ember with it than ember without (8.7 apart)
    base = base_f32.model.score(IDS)
    assert (ours - theirs).abs().max() < (base - theirs).abs().max() / 3


def test_saved_kv_is_reused_only_with_the_adapter_it_was_computed_with(
        adapters, smollm2_gguf, tmp_path) -> None:
    """A conversation file's blocks are keyed with the adapter's identity: loaded for
    the base model or another adapter they cover nothing, for the same adapter all."""
    import ember

    llm = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=128,
                    loras={"peft": adapters["peft"], "gguf": adapters["gguf"]})
    text = "A long shared preamble about the weather in several cities, " * 3
    path = tmp_path / "kv.ember"
    saved = llm.save_prefix(text, path, lora="peft")
    assert saved > 0
    fresh = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=128,
                      loras={"peft": adapters["peft"], "gguf": adapters["gguf"]})
    assert fresh.load_prefix(path) == [] and fresh.load_prefix(path, lora="gguf") == []
    assert len(fresh.load_prefix(path, lora="peft")) == saved


def test_speculation_and_grammars_work_with_an_adapter(adapters, smollm2_gguf) -> None:
    """Drafts are verified with the request's adapter (the same tokens with speculation
    on and off), and a grammar constrains an adapter's reply as any other."""
    import ember
    from ember.sampling.constraints import StructuredOutput

    text = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for spec in ("auto", "off"):
        llm = ember.LLM(str(smollm2_gguf), weights="f32", num_kv_blocks=64, speculation=spec,
                        loras={"peft": adapters["peft"]})
        outs[spec] = llm.generate([text], greedy, lora="peft")[0]
    assert outs["auto"].token_ids == outs["off"].token_ids
    assert outs["auto"].spec is not None and outs["auto"].spec.accepted > 0
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=64,
                            structured=StructuredOutput.json_schema(schema))
    reply = llm.generate(["Give me a number as JSON:"], params, lora="peft")[0]
    assert isinstance(json.loads(reply.text)["n"], int)
