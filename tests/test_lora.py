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

import numpy as np
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


@pytest.mark.parametrize("weights", ["f32", "q4"])
def test_mixed_adapters_in_one_batch_equal_each_alone(adapters, smollm2_gguf, weights,
                                                     request) -> None:
    """The base and two adapters, four requests in one batch: each gives the tokens it
    gives alone, op by op (f32) and in the fused native stack (q4: its logprobs too,
    bitwise); no prefix is shared across adapters."""
    import ember

    loaded = request.getfixturevalue("base_f32" if weights == "f32" else "smollm2_q4")
    llm = ember.LLM(str(smollm2_gguf), weights=weights, num_kv_blocks=128, loaded=loaded,
                    loras={"peft": adapters["peft"], "gguf": adapters["gguf"]})
    assert (llm.engine.loaded.model.native is not None) == (weights == "q4")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
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
    if weights == "q4":  # batch invariant (f32's BLAS sums differently per batch size)
        assert [r.logprobs for r in reqs] == [o.logprobs for o in alone]
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


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_native_stack_adds_the_deltas_the_op_by_op_path_adds(
        adapters, smollm2_q4, dtype) -> None:
    """q4 SmolLM2 with an adapter (held in f32 or bf16): the fused stack is as far from
    the op-by-op path on the same packed weights as it is without one (their int8
    activations differ), and a zero adapter is the base bitwise."""
    model, cfg = smollm2_q4.model, smollm2_q4.config
    peft = load_lora(adapters["peft"], "peft", cfg, dtype=dtype)
    fused, fused_base = model.score(IDS, lora=peft), model.score(IDS)
    saved, model.native = model.native, None
    try:
        op, op_base = model.score(IDS, lora=peft), model.score(IDS)
    finally:
        model.native = saved

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x - y).norm() / y.norm()).item()

    print(f"fused vs op by op: {rel(fused, op):.4f} with the adapter, "
          f"{rel(fused_base, op_base):.4f} without; the adapter moves logits "
          f"{rel(op, op_base):.3f}")
    assert rel(op, op_base) > 0.1
    assert rel(fused, op) < 1.5 * rel(fused_base, op_base) + 1e-3
    zero = load_lora(adapters["zero"], "zero", cfg, dtype=dtype)
    assert torch.equal(model.score(IDS, lora=zero), fused_base)


@pytest.mark.parametrize("build", ["native", "scalar", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_delta_kernel_is_the_low_rank_product_and_batch_invariant(
        dtype, build) -> None:
    """lora_delta (the stack's code, bound alone): y += B (A x) per token on its
    adapter's columns, rows of no adapter untouched; each token's result is bitwise the
    same alone, in a mixed batch (tokens of one adapter in blocks of two and three),
    and on one thread or two. Weights in f32 or bf16 (widened exactly); this machine's
    build, the portable one and plain AVX2."""
    from native import build_variant, require_kernels

    ext = require_kernels() if build == "native" else build_variant(build)
    assert build == "native" or ext.simd() == build
    q, kv, hidden, ffn = 64, 32, 96, 160  # not multiples of 32: the dot tails run too
    stack = ext.DecoderStack(hidden, 8, 4, 8, 8, ffn, 1e-5)
    stack.add_layer(torch.ones(hidden), torch.ones(hidden),
                    *(_packed(ext, n, k) for n, k in ((q + 2 * kv, hidden), (hidden, q),
                                                      (2 * ffn, hidden), (hidden, ffn))))
    g = torch.Generator().manual_seed(0)
    adapters, dense = [], []
    for rank in (3, 8):
        w, parts = stack.new_lora(), []
        # parts of 40, 37 and 20 columns (vector blocks of 32 and their tails), gaps
        for lo, n in ((0, 40), (50, 37), (q + kv, 20)):
            a = torch.randn(rank, hidden, generator=g).to(dtype)
            b = torch.randn(n, rank, generator=g).to(dtype)
            w.set(0, 0, lo, a, b.T.contiguous())
            parts.append((lo, a, b))
        adapters.append(w)
        dense.append(parts)
    T = 7
    x = torch.randn(T, hidden, generator=g)
    base = torch.randn(T, q + 2 * kv, generator=g)
    which = torch.tensor([1, -1, 0, 1, 1, -1, 0])
    got = ext.lora_delta(adapters, which, 0, 0, x, base.clone())
    want = base.clone()
    for t, w in enumerate(which.tolist()):
        for lo, a, b in dense[w] if w >= 0 else []:
            want[t, lo:lo + b.shape[0]] += b.float() @ (a.float() @ x[t])
    assert torch.equal(got[which < 0], base[which < 0])
    for gap in (slice(40, 50), slice(87, q + kv), slice(q + kv + 20, None)):
        assert torch.equal(got[:, gap], base[:, gap])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for t in range(T):
                alone = ext.lora_delta(adapters, which[t:t + 1], 0, 0, x[t:t + 1].clone(),
                                       base[t:t + 1].clone())
                assert torch.equal(alone[0], got[t]), (n, t)
    finally:
        torch.set_num_threads(threads)
    # what does not fit is refused, naming it
    with pytest.raises(RuntimeError, match="do not fit a projection of 96 inputs"):
        adapters[0].set(0, 0, 0, torch.zeros(2, 95), torch.zeros(2, q))
    with pytest.raises(RuntimeError, match="same output columns"):
        adapters[0].set(0, 0, 1, torch.zeros(2, hidden), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="columns past"):
        adapters[0].set(0, 3, 90, torch.zeros(2, ffn), torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="out of range"):
        ext.lora_delta(adapters, torch.full((T,), 2), 0, 0, x, base.clone())
    other = ext.DecoderStack(hidden, 8, 4, 8, 8, ffn, 1e-5).new_lora()  # no layers
    pool = torch.zeros(1, 1, 2, 16, 4, 8)
    with pytest.raises(RuntimeError, match="another stack"):
        stack.forward(x[:1].clone(), pool, [torch.zeros(1, 4, 2)], torch.zeros(1, dtype=torch.long),
                      torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                      torch.zeros(1, dtype=torch.long), [other], torch.zeros(1, dtype=torch.long))


def _packed(ext, n: int, k: int):
    """A packed Q8_0 matrix [n, k] of random weights (k a multiple of 32), for ``ext``."""
    import gguf
    import numpy as np

    from ember.models.gguf import GGMLType
    from ember.models.linear import QuantLinear

    w = np.random.default_rng(n * k).standard_normal((n, k), dtype=np.float32)
    raw = gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    packed = QuantLinear.from_raw([(raw.reshape(-1), GGMLType.Q8_0, (n, k))]).packed
    return ext.PackedLinear(k, packed.segments)


def test_unknown_adapter_and_unload(adapters, smollm2_gguf, base_f32) -> None:
    import ember
    from ember.engine.intake import InvalidRequest

    llm = ember.LLM(str(smollm2_gguf), weights="f32", loaded=base_f32, num_kv_blocks=64,
                    loras={"peft": adapters["peft"]})
    with pytest.raises(InvalidRequest, match="'nope'") as e:
        llm.generate(["Hi"], SamplingParams(max_tokens=2), lora="nope")
    assert e.value.param == "lora"
    llm.unload_lora("peft")
    with pytest.raises(InvalidRequest, match="'peft'"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2), lora="peft")


def test_resident_adapters_are_bounded_and_reloaded_from_their_files(
        adapters, smollm2_gguf, base_f32, tmp_path) -> None:
    """--max-loras 1: loading a second adapter evicts the first; a request for it reads
    it again (same tokens as before), and a file changed meanwhile is refused."""
    import ember
    from ember.engine.intake import InvalidRequest

    copy = tmp_path / "copy"
    shutil.copytree(adapters["peft"], copy)
    llm = ember.LLM(str(smollm2_gguf), weights="f32", loaded=base_f32, num_kv_blocks=64,
                    max_loras=1, loras={"peft": copy})
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


def _with_nan(src: Path, dst: Path, tensor: str) -> Path:
    """A copy of GGUF adapter ``src`` with the first value of ``tensor`` set to NaN."""
    import numpy as np

    from ember.models.gguf import GGUFFile

    with GGUFFile(src) as g:
        info = g.tensors[tensor]
        offset = info.offset
        assert info.type_name == "F32", info.type_name
    data = bytearray(src.read_bytes())
    data[offset:offset + 4] = np.float32("nan").tobytes()
    dst.write_bytes(bytes(data))
    return dst


def test_a_path_that_is_no_regular_file_is_refused_before_it_is_read(
        adapters, base_f32, tmp_path) -> None:
    """/dev/zero (never ends), a FIFO (blocks the open) and a sparse file larger than any
    adapter of this base are refused at once, naming the path; a file that is not a
    GGUF is refused without a byte of it in the message."""
    cfg = base_f32.config
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "peft").mkdir()
    os.mkfifo(tmp_path / "peft" / "adapter_config.json")
    (tmp_path / "peft" / "adapter_model.safetensors").write_bytes(b"")
    for path in ("/dev/zero", fifo, tmp_path / "peft"):
        with pytest.raises(LoRAError, match="not a regular file"):
            load_lora(path, "x", cfg)
    huge = tmp_path / "huge.gguf"
    with open(huge, "wb") as f:
        f.truncate(64 << 30)  # sparse: nothing written
    with pytest.raises(LoRAError, match="more than an adapter of this base model can be"):
        load_lora(huge, "x", cfg)
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(LoRAError, match="not a GGUF file") as e:
        load_lora(secret, "x", cfg)
    assert "root" not in str(e.value).replace(str(tmp_path), "")


def test_non_finite_adapters_are_refused_naming_the_tensor(adapters, base_f32,
                                                            tmp_path) -> None:
    """A NaN in a GGUF adapter's lora_a, a NaN in a PEFT adapter's lora_B, and a NaN or
    infinite alpha: each refused at load, naming what holds it."""
    from gguf import GGUFReader, GGUFWriter
    from safetensors.torch import load_file, save_file

    cfg = base_f32.config
    tensor = "blk.0.attn_q.weight.lora_a"
    with pytest.raises(Exception, match=f"{tensor}.*non-finite"):
        load_lora(_with_nan(adapters["gguf"], tmp_path / "nan.gguf", tensor), "x", cfg)
    peft = tmp_path / "peft-nan"
    shutil.copytree(adapters["peft"], peft)
    tensors = load_file(peft / "adapter_model.safetensors")
    key = next(k for k in tensors if ".v_proj.lora_B." in k)
    tensors[key][0, 0] = float("inf")
    save_file(tensors, peft / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="attn_v: lora_b holds non-finite"):
        load_lora(peft, "x", cfg)
    reader = GGUFReader(adapters["gguf"])
    for alpha in (float("nan"), float("inf")):
        out = tmp_path / f"alpha-{alpha}.gguf"
        w = GGUFWriter(out, "llama")
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", alpha)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_shape=None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(LoRAError, match="scale \\(alpha\\) holds non-finite"):
            load_lora(out, "x", cfg)


def test_a_moe_base_takes_attention_adapters_and_refuses_ffn_targets(
        tiny_moe_gguf, tmp_path) -> None:
    """On a base with routed experts an adapter on the attention projections gives the
    logits of the base with W + s·BA merged into those weights (f32); one that also
    targets the FFN is refused, naming the target."""
    from ember.bench.lora import write_random_adapter
    from ember.models.lora import ATTENTION_TARGETS

    model = load_model(str(tiny_moe_gguf), "f32")
    cfg = model.config
    assert cfg.n_experts
    path = write_random_adapter(cfg, 4, 0, tmp_path / "attn.gguf", std=0.3,
                                targets=ATTENTION_TARGETS)
    adapter = load_lora(path, "attn", cfg)
    ids = IDS[:12]
    ours, base = model.model.score(ids, lora=adapter), model.model.score(ids)
    merged = load_model(str(tiny_moe_gguf), "f32").model
    for (i, _), d in adapter.deltas.items():
        which = merged.layers[i].qkv if d.fused == 0 else merged.layers[i].o
        which.weight[d.lo:d.lo + d.bt.shape[1]] += (d.a.T @ d.bt).T
    want = merged.score(ids)
    assert (base - want).abs().max() > 0.1  # the adapter changes the logits visibly
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    every = write_random_adapter(cfg, 4, 0, tmp_path / "all.gguf")
    with pytest.raises(LoRAError, match="blk.0.ffn_gate.*routed experts.*attn_output only"):
        load_lora(every, "all", cfg)
    # q4: the routed experts run in the fused stack, the adapter's deltas inside it
    q4 = load_model(str(tiny_moe_gguf), "q4").model
    assert q4.native is not None
    fused = q4.score(ids, lora=adapter)
    saved, q4.native = q4.native, None
    op_by_op = q4.score(ids, lora=adapter)
    q4.native = saved
    assert ((fused - op_by_op).norm() / op_by_op.norm()).item() < 0.02
    assert ((fused - ours).norm() / ours.norm()).item() < 0.05  # q4's rounding of f32


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
        adapters, smollm2_gguf, base_f32, tmp_path) -> None:
    """A conversation file's blocks are keyed with the adapter's identity: loaded for
    the base model or another adapter they cover nothing, for the same adapter all."""
    import ember

    llm = ember.LLM(str(smollm2_gguf), weights="f32", loaded=base_f32, num_kv_blocks=128,
                    loras={"peft": adapters["peft"], "gguf": adapters["gguf"]})
    text = "A long shared preamble about the weather in several cities, " * 3
    path = tmp_path / "kv.ember"
    saved = llm.save_prefix(text, path, lora="peft")
    assert saved > 0
    fresh = ember.LLM(str(smollm2_gguf), weights="f32", loaded=base_f32, num_kv_blocks=128,
                      loras={"peft": adapters["peft"], "gguf": adapters["gguf"]})
    assert fresh.load_prefix(path) == [] and fresh.load_prefix(path, lora="gguf") == []
    assert len(fresh.load_prefix(path, lora="peft")) == saved


def test_speculation_and_grammars_work_with_an_adapter(adapters, smollm2_gguf,
                                                     base_f32) -> None:
    """Drafts are verified with the request's adapter (the same tokens with speculation
    on and off), and a grammar constrains an adapter's reply as any other."""
    import ember
    from ember.sampling.constraints import StructuredOutput

    text = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for spec in ("auto", "off"):
        llm = ember.LLM(str(smollm2_gguf), weights="f32", loaded=base_f32, num_kv_blocks=64,
                        speculation=spec, loras={"peft": adapters["peft"]})
        outs[spec] = llm.generate([text], greedy, lora="peft")[0]
    assert outs["auto"].token_ids == outs["off"].token_ids
    assert outs["auto"].spec is not None and outs["auto"].spec.accepted > 0
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=64,
                            structured=StructuredOutput.json_schema(schema))
    reply = llm.generate(["Give me a number as JSON:"], params, lora="peft")[0]
    assert isinstance(json.loads(reply.text)["n"], int)


def test_resident_adapters_are_shared_fairly_between_tenants(adapters, base_f32) -> None:
    """max_loras 3: a tenant cycling through four adapters evicts its own, never the
    quiet tenant's one (plain LRU evicted it first); max_adapters 1 for tenant "capped"
    keeps it to one resident adapter even with room to spare."""
    from ember.engine.adapters import LoRARegistry

    reg = LoRARegistry(base_f32.config, max_loras=3,
                       max_per_tenant=lambda t: 1 if t == "capped" else None)
    reg.load("q", str(adapters["gguf"]))
    assert reg.get("q", tenant="quiet") is not None
    for name in ("f1", "f2", "f3", "f4"):
        reg.load(name, str(adapters["gguf"]))
    for _ in range(3):
        for name in ("f1", "f2", "f3", "f4"):
            reg.get(name, tenant="flood")
    stats = reg.metrics()
    assert stats["resident"] == 3 and stats["adapters"]["q"]["resident"] == 1
    assert stats["adapters"]["q"]["evictions"] == 0
    assert reg.resident_by_tenant() == {"quiet": 1, "flood": 2}

    reg = LoRARegistry(base_f32.config, max_loras=3,
                       max_per_tenant=lambda t: 1 if t == "capped" else None)
    for name in ("a", "b"):
        reg.load(name, str(adapters["gguf"]))
        reg.get(name, tenant="capped")
    assert reg.resident_by_tenant() == {"capped": 1}
    assert reg.metrics()["adapters"]["a"]["resident"] == 0
