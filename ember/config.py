"""EngineConfig: every engine option in one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from ember.models.registry import DEFAULT_MODEL


class InvalidConfig(ValueError):
    """An engine option is out of range; the message names the option and its value."""


@dataclass
class EngineConfig:
    """Options of an :class:`~ember.LLM` engine (and of ``ember serve``).

    ``kv_cache_bytes`` sizes the paged KV pool unless ``num_kv_blocks`` is given.
    ``max_model_len`` (prompt + output) defaults to the model's context length.
    ``weights`` defaults to ``f32``, the exact oracle; ``auto`` picks ``q4`` (native
    int4/int8 kernels, ~5x faster decode) where its kernel builds.
    """

    model: str = DEFAULT_MODEL
    weights: str = "f32"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_bytes: int = 2 * 1024**3
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_queue: int = 1024
    enable_prefix_caching: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfig(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_bytes",
                     "max_queue"):
            positive(name)
        for name in ("num_kv_blocks", "max_model_len", "threads"):
            positive(name, allow_none=True)
        if self.block_size & (self.block_size - 1):
            raise InvalidConfig(f"block_size must be a power of two, got {self.block_size}")
        from ember.models.linear import WEIGHT_CHOICES

        if self.weights not in WEIGHT_CHOICES:
            raise InvalidConfig(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, "
                                f"got {self.weights!r}")
        if not isinstance(self.model, str) or not self.model:
            raise InvalidConfig(f"model must be an alias or a .gguf path, got {self.model!r}")
