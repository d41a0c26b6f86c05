"""ember: an LLM inference engine and OpenAI-compatible server for GGUF models."""

from ember.config import EngineConfig
from ember.engine.engine import RequestOutput
from ember.llm import LLM
from ember.sampling.params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
