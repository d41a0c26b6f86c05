"""ember: an LLM inference engine and OpenAI-compatible server for GGUF models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.config import EngineConfig
    from ember.engine.output import RequestOutput
    from ember.llm import LLM
    from ember.sampling.params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

# Imported on first use (PEP 562): importing torch takes ~2 s, and commands such as
# `ember models`, `ember pull` or `ember tokenize` (and their error paths) need none of it.
_LAZY = {
    "LLM": "ember.llm",
    "EngineConfig": "ember.config",
    "RequestOutput": "ember.engine.engine",
    "SamplingParams": "ember.sampling.params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
