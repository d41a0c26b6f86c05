"""Shared fixtures: real models are resolved once per session and shared."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from native import require_kernels

from ember.models.gguf import GGUFFile

# ---- the suite's time: each test's durations stored, and a budget the run must keep ----
_durations: dict[str, float] = {}
_began = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every phase of every test (under xdist the controller sees the workers' reports)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the durations to ``EMBER_TEST_DURATIONS`` (JSON, slowest first), and fail a
    run that passed but took longer than ``EMBER_SUITE_BUDGET`` seconds (``make test``
    and ``make check`` set both): a suite that grows slow is caught when it does."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wall = time.monotonic() - _began
    out = os.environ.get("EMBER_TEST_DURATIONS")
    if out and _durations:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        ranked = dict(sorted(_durations.items(), key=lambda kv: -kv[1]))
        Path(out).write_text(json.dumps({"wall_seconds": round(wall, 1),
                                         "tests": {k: round(v, 3) for k, v in ranked.items()}},
                                        indent=1))
    budget = os.environ.get("EMBER_SUITE_BUDGET")
    if budget and exitstatus == 0 and wall > float(budget):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the suite took {wall:.0f} s, over its budget of {budget} s "
                                f"(EMBER_SUITE_BUDGET); the slowest tests are in "
                                f"{out or 'EMBER_TEST_DURATIONS'}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2``), each worker keeps to its own
    core, with everything it starts (servers, loaders, compilers): engines size their
    thread pools from the cores they may use, so two workers each run one thread instead
    of two workers fighting over two OpenMP pools that spin-wait for each other.

    torch's own pool was sized when it was imported, before the pinning, so it is
    resized here too: left at two threads on one core, every torch op outside an
    engine (loading, ``model.score``, transformers' oracles) spun against itself,
    1.4-13x slower than alone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if len(cpus) >= workers > 1:
        index = int(worker[2:])
        share = len(cpus) // workers
        os.sched_setaffinity(0, cpus[index * share:(index + 1) * share])
        import torch

        torch.set_num_threads(share)


def _resolve(alias: str) -> Path:
    from ember.models.registry import ensure_model

    return ensure_model(alias)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (pulled into $EMBER_HOME)."""
    return _resolve("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_file(smollm2_gguf: Path) -> GGUFFile:
    return GGUFFile(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf: Path):
    """One ``ember.LLM`` over the real SmolLM2-135M, shared by every test that needs it.

    f32 weights and KV, the exact oracle (the Python API defaults to q4 and f16 KV): the
    tests that use it compare streams across batch shapes, which q4's int8 activations do
    not keep bit-identical, and against transformers and llama.cpp.
    """
    import ember

    return ember.LLM("smollm2-135m", weights="f32", kv_dtype="f32")


@pytest.fixture(scope="session")
def smollm2_served_llm(smollm2_gguf: Path):
    """One ``ember.LLM`` over the real SmolLM2 in the weight format ``ember serve`` runs
    by default (q4 where its kernel builds, f16 KV), shared: the oracle of the e2e
    ``smol_server``, and the model of the tests about what a grammar lets it write, not
    about its exact numbers (f32 decoding is several times slower)."""
    import ember
    from ember import kernels

    return ember.LLM(str(smollm2_gguf), weights="q4" if kernels.available() else "f32")


@pytest.fixture(scope="session")
def smollm2_q4(smollm2_gguf: Path):
    """The real SmolLM2-135M in the q4 format (the fused native stack), loaded once."""
    return _load_q4(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_file() -> GGUFFile:
    """The real Gemma 3 270M Q4_K_M GGUF (Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors).

    Pulled like any registered model; a failed pull or checksum is a test error, never
    a skip, so the tests that need it cannot silently stop running.
    """
    return GGUFFile(_resolve("gemma3-270m"))


@pytest.fixture(scope="session")
def gemma3_llm(gemma3_file: GGUFFile):
    """One f32 ``ember.LLM`` (f32 KV: the exact oracle) over the real Gemma 3 270M, shared
    by the tests that need it."""
    import ember

    return ember.LLM("gemma3-270m", weights="f32", kv_dtype="f32")


# ---- tiny random-weight model: fast engine tests ----
@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, smollm2_file: GGUFFile) -> Path:
    from tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", smollm2_file)


@pytest.fixture(scope="session")
def tiny_qwen_ggufs(tmp_path_factory: pytest.TempPathFactory, smollm2_file: GGUFFile
                    ) -> dict[str, Path]:
    """Qwen 2 / Qwen 3 tiny models (tiny_model.TINY_QWEN), for transformers and e2e."""
    from tiny_model import TINY_QWEN, write_tiny_llama

    out = tmp_path_factory.mktemp("tiny-qwen")
    return {arch: write_tiny_llama(out / f"tiny-{arch}.gguf", smollm2_file, arch=arch,
                                   n_layers=3, rope_base=1e6, untied=True, seed=1, **kw)
            for arch, kw in TINY_QWEN.items()}


@pytest.fixture(scope="session")
def tiny_moe_gguf(tmp_path_factory: pytest.TempPathFactory, smollm2_file: GGUFFile) -> Path:
    """A Qwen3-MoE model: 3 layers of 8 experts (2 used per token), Q8_0."""
    from ember.bench.moe_model import write_moe_gguf

    return write_moe_gguf(tmp_path_factory.mktemp("tiny-moe") / "tiny-moe.gguf", smollm2_file,
                          n_layers=3, n_experts=8, n_used=2, hidden=64, expert_ffn=128)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_gguf: Path):
    from ember.models.loader import load_model

    return load_model(str(tiny_gguf), "f32")


@pytest.fixture(scope="session")
def tiny_loaded_q4(tiny_gguf: Path):
    """The tiny model in the q4 format: its Q8_0 matrices packed, the fused native stack."""
    return _load_q4(tiny_gguf)


def _load_q4(path: Path):
    """``path`` loaded as q4, running the fused native stack (see tests/native.py)."""
    from ember.models.loader import load_model

    require_kernels()
    loaded = load_model(str(path), "q4")
    assert loaded.model.native is not None
    return loaded


def _engine_maker(request, gguf: Path, f32: str, q4: str):
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    def make(**options):
        options.setdefault("num_kv_blocks", 256)  # small pool: cheap to allocate per test
        options.setdefault("threads", 1)  # tiny matrices: a second thread only adds sync cost
        options.setdefault("weights", "f32")
        loaded = request.getfixturevalue(q4 if options["weights"] == "q4" else f32)
        return LLMEngine(EngineConfig(model=str(gguf), **options), loaded=loaded)

    return make


@pytest.fixture
def make_tiny_engine(request, tiny_gguf: Path):
    """Build an LLMEngine over the shared tiny model with the given options
    (``weights="q4"`` loads and shares the q4 copy on first use)."""
    return _engine_maker(request, tiny_gguf, "tiny_loaded", "tiny_loaded_q4")


# ---- the tiny model with head_dim 32: a head's row is one q8_0 block (kv_dtype="q8_0";
# the tiny model's head_dim 16 is refused for it) ----
@pytest.fixture(scope="session")
def tiny32_gguf(tmp_path_factory: pytest.TempPathFactory, smollm2_file: GGUFFile) -> Path:
    from tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny32") / "tiny32-llama.gguf",
                            smollm2_file, hidden=128, ffn=256)


@pytest.fixture(scope="session")
def tiny32_loaded(tiny32_gguf: Path):
    from ember.models.loader import load_model

    return load_model(str(tiny32_gguf), "f32")


@pytest.fixture(scope="session")
def tiny32_loaded_q4(tiny32_gguf: Path):
    return _load_q4(tiny32_gguf)


@pytest.fixture
def make_tiny32_engine(request, tiny32_gguf: Path):
    """make_tiny_engine over the head_dim-32 tiny model."""
    return _engine_maker(request, tiny32_gguf, "tiny32_loaded", "tiny32_loaded_q4")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path):
    """transformers' own LlamaForCausalLM of the real SmolLM2, dequantized from the same
    GGUF (float32, eval mode): the logits oracle of tests/test_oracle_transformers.py and
    the base of the LoRA adapters (tests/lora_adapters.py, which wraps a copy).

    Loaded once (~8 s: gguf-py dequantizes every tensor in Python) and kept for the
    session (~0.6 GB); nothing may change it in place."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from hf_gguf import transformers_from_gguf

    return transformers_from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_adapters(smollm2_gguf: Path, request):
    """A PEFT LoRA for SmolLM2 as a directory and as llama.cpp's GGUF adapter, a zero
    adapter, and transformers + PEFT's logits (tests/lora_adapters.py). Kept on disk by
    everything they depend on (tests/oracle_cache.py); transformers' SmolLM2 is built only
    when they are made."""
    peft = pytest.importorskip("peft")
    import torch
    from llamacpp_source import llamacpp_source
    from lora_adapters import build_adapters
    from oracle_cache import cached_dir, file_key

    here = Path(__file__).parent
    key = [file_key(smollm2_gguf), (here / "lora_adapters.py").read_bytes(),
           (here / "hf_gguf.py").read_bytes(), peft.__version__.encode(),
           (llamacpp_source() / "convert_lora_to_gguf.py").read_bytes()]

    def build(root: Path) -> None:
        made = build_adapters(request.getfixturevalue("smollm2_hf"), root)
        torch.save(made["oracle"], root / "oracle.pt")

    root = cached_dir("smollm2-lora", key, build)
    return {"peft": root / "peft", "gguf": root / "adapter.gguf", "zero": root / "zero",
            "oracle": torch.load(root / "oracle.pt", weights_only=True)}


@pytest.fixture(scope="session")
def qwen3_reranker(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    """A random-weight Qwen3 checkpoint named as a Qwen3-Reranker, converted by llama.cpp's
    converter, which makes it one (pooling_type 4, a ``cls.output`` head of the "yes" and
    "no" rows of the LM head, the rerank template): (GGUF path, transformers model,
    checkpoint directory)."""
    pytest.importorskip("transformers")
    from hf_families import FAMILIES, Family, random_checkpoint, tokenizer_files
    from llamacpp_source import Converter

    root = tmp_path_factory.mktemp("reranker")
    name = "qwen3-reranker"  # the converter knows a reranker by its directory's name
    FAMILIES[name] = Family("Qwen3Config", {"head_dim": 16})
    try:
        hf = random_checkpoint(name, root / f"{name}-hf", tokenizer_files(root / "tok",
                                                                          smollm2_gguf))
    finally:
        del FAMILIES[name]
    converter = Converter()
    try:
        (gguf,) = converter.convert([(root / f"{name}-hf", root / "reranker.gguf", ())])
    finally:
        converter.close()
    return gguf, hf, root / f"{name}-hf"


@pytest.fixture(scope="session", params=["bert", "nomic-bert"])
def bert_files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A random BERT encoder of each family (transformers, the oracle) and its GGUF with
    mean and with CLS pooling: (model, {"mean": path, "cls": path})."""
    pytest.importorskip("transformers")
    import bert_model
    from llamacpp_source import llamacpp_source

    from ember.models.gguf import GGUFFile

    family = request.param
    random, write = {"bert": (bert_model.random_bert, bert_model.write_bert),
                     "nomic-bert": (bert_model.random_nomic_bert,
                                    bert_model.write_nomic_bert)}[family]
    vocab_file = llamacpp_source() / "models" / "ggml-vocab-bert-bge.gguf"
    vocab = len(GGUFFile(vocab_file).metadata["tokenizer.ggml.tokens"])
    model = random(vocab)
    root = tmp_path_factory.mktemp(family)
    return model, {name: write(root / f"{family}-{name}.gguf", model, vocab_file, pooling)
                   for name, pooling in (("mean", 1), ("cls", 2))}
