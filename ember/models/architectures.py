"""The table from a GGUF's ``general.architecture`` to its family.

A family says how it differs from the shared decoder (:mod:`ember.models.decoder`):
its ``configure`` hook turns GGUF metadata into :class:`ModelConfig` fields, and it
may bring a chat template for files that carry none. Adding a family adds a row
here and a file beside this one; the engine, scheduler and server do not change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.errors import UnsupportedModelError
from ember.models import (
    bert,
    gemma2,
    gemma3,
    gpt_oss,
    granite,
    llama,
    mistral3,
    olmo2,
    phi3,
    qwen,
    qwen35,
    smollm3,
)
from ember.models.config import EXTENDED_ROPE_SCALINGS, ModelConfig, rope_yarn
from ember.models.decoder import DecoderModel
from ember.models.gguf import GGUFFile


@dataclass(frozen=True)
class Architecture:
    configure: Callable[[GGUFFile, ModelConfig], dict[str, Any]]
    model: type[DecoderModel] = DecoderModel
    chat_template: str | None = None  # used when the GGUF has no tokenizer.chat_template
    rope_scalings: tuple[str, ...] = ()  # of EXTENDED_ROPE_SCALINGS, those configure reads


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(llama.configure, rope_scalings=("yarn",)),
    "qwen2": Architecture(qwen.configure_qwen2, rope_scalings=("yarn",)),
    "qwen3": Architecture(qwen.configure_qwen3, rope_scalings=("yarn",)),
    "qwen3moe": Architecture(qwen.configure_qwen3moe, rope_scalings=("yarn",)),
    "gemma3": Architecture(gemma3.configure, chat_template=gemma3.CHAT_TEMPLATE),
    "gemma2": Architecture(gemma2.configure, chat_template=gemma3.CHAT_TEMPLATE),
    "phi3": Architecture(phi3.configure, rope_scalings=("longrope",)),
    "granite": Architecture(granite.configure),
    "olmo2": Architecture(olmo2.configure),
    "smollm3": Architecture(smollm3.configure, rope_scalings=("yarn",)),
    "mistral3": Architecture(mistral3.configure, rope_scalings=("yarn",)),
    "gpt-oss": Architecture(gpt_oss.configure, rope_scalings=("yarn",)),
    "qwen35": Architecture(qwen35.configure, model=qwen35.Qwen35Model),
    "qwen35moe": Architecture(qwen35.configure, model=qwen35.Qwen35Model),
    "bert": Architecture(bert.configure, model=bert.BertModel),  # type: ignore[arg-type]
    "nomic-bert": Architecture(bert.configure, model=bert.BertModel),  # type: ignore[arg-type]
}


def model_config(gguf: GGUFFile) -> ModelConfig:
    """A GGUF's model configuration: the keys every family shares, then its family's.
    An architecture not in the table is refused by name."""
    family = ARCHITECTURES.get(gguf.architecture)
    if family is None:
        raise UnsupportedModelError(
            f"{gguf.path.name}: architecture {gguf.architecture!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})")
    scaling = gguf.get(f"{gguf.architecture}.rope.scaling.type")
    if scaling in EXTENDED_ROPE_SCALINGS and scaling not in family.rope_scalings:
        raise UnsupportedModelError(f"{gguf.path.name}: RoPE scaling {scaling!r} is not "
                                    f"supported for {gguf.architecture}")
    base = dataclasses.replace(ModelConfig.common(gguf), **rope_yarn(gguf))
    return dataclasses.replace(base, **family.configure(gguf, base))
