"""Shared fixtures: real models are resolved once per session and shared."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.models.gguf import GGUFFile


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
    """One ``ember.LLM`` over the real SmolLM2-135M, shared by every test that needs it."""
    import ember

    return ember.LLM("smollm2-135m")


# ---- BEGIN gemma3_file fixture (added with tests/test_quant.py; provisional) ----
# Falls back to the background-assembled copy while the registry entry is new;
# skips when neither is available.
_GEMMA3_FALLBACK = Path("/tmp/models/gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="session")
def gemma3_file() -> GGUFFile:
    """The real Gemma 3 270M Q4_K_M GGUF (Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors)."""
    try:
        path = _resolve("gemma3-270m")
    except Exception:
        path = _GEMMA3_FALLBACK
    if not path.is_file():
        pytest.skip(f"Gemma 3 270M GGUF not available (looked for {path})")
    return GGUFFile(path)


# ---- END gemma3_file fixture ----


# ---- tiny random-weight model: fast engine tests ----
@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, smollm2_file: GGUFFile) -> Path:
    from tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", smollm2_file)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_gguf: Path):
    from ember.models.loader import load_model

    return load_model(str(tiny_gguf))


@pytest.fixture
def make_tiny_engine(tiny_loaded, tiny_gguf: Path):
    """Build an LLMEngine over the shared tiny model with the given options."""
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    def make(**options):
        options.setdefault("num_kv_blocks", 256)  # small pool: cheap to allocate per test
        options.setdefault("threads", 1)  # tiny matrices: a second thread only adds sync cost
        return LLMEngine(EngineConfig(model=str(tiny_gguf), **options), loaded=tiny_loaded)

    return make
