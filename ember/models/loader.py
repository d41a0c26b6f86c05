"""Load a model by alias or path: weights, tokenizer and chat template together."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.chat_template import ChatTemplate
from ember.errors import ChatTemplateError, GGUFError
from ember.models.architectures import ARCHITECTURES, model_config
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderModel
from ember.models.files import sha256_of
from ember.models.gguf import GGUFFile
from ember.models.linear import resolve_weights, weight_format
from ember.models.moe import MoEOptions
from ember.models.registry import MODELS, ensure_model
from ember.tokenizer import Tokenizer

log = logging.getLogger(__name__)
RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    weights: str
    load_seconds: float
    files: tuple[Path, ...] = ()  # every file the model was read from (a split model's parts)
    # a reranker's prompt, {query} and {document} in it (tokenizer.chat_template.rerank)
    rerank_template: str | None = None

    @property
    def name(self) -> str:
        for spec in MODELS.values():
            if spec.filename == self.path.name:
                return spec.alias
        return self.path.stem

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Raw text gets BOS when the GGUF asks for it; token ids pass through."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos)
        return list(prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **variables: Any) -> list[int]:
        """Render the chat template (``variables``: e.g. ``tools``); its control tokens
        (and none typed in messages) count."""
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.name} has no chat template; use a raw prompt")
        segments = self.chat_template.render_segments(
            messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.tokenizer.encode_segments(segments)

    def fingerprint(self) -> str:
        """Identity of the numbers this model computes: file checksum + weight format.

        Part of every prefix-cache salt, so a cache can never be reused across models
        or formats. Registered files use the registry checksum (verified at pull); a
        split model's checksum covers every part.
        """
        for spec in MODELS.values():
            if spec.filename == self.path.name and self.path.stat().st_size == spec.size:
                return f"{spec.sha256}:{self.weights}"
        files = self.files or (self.path,)
        digest = sha256_of(self.path, remember=True) if len(files) == 1 else hashlib.sha256(
            "".join(sha256_of(f, remember=True) for f in files).encode()).hexdigest()
        return f"{digest}:{self.weights}"


def load_model_meta(name: str, weights: str = "auto") -> LoadedModel:
    """Everything of ``name`` but its weights (``model`` is None): the tokenizer, chat
    template and config, for a process that routes requests to replicas holding the
    model. Its ``fingerprint`` equals theirs (same file, same weight format)."""
    start = time.perf_counter()
    path = ensure_model(name)
    with GGUFFile(path) as gguf:
        config = model_config(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
        template = _chat_template(gguf, config)
        files = tuple(p for p, _ in gguf.parts)
        rerank = gguf.get(RERANK_TEMPLATE_KEY)
    return LoadedModel(path, config, None, tokenizer, template,  # type: ignore[arg-type]
                       resolve_weights(weights), time.perf_counter() - start, files, rerank)


def _chat_template(gguf: GGUFFile, config: ModelConfig) -> ChatTemplate | None:
    """The GGUF's chat template, else its family's; None for a base model without one,
    or with one that cannot render a user turn (said at load, by the template's own
    error): the model can still complete raw text."""
    try:
        template = ChatTemplate.from_gguf(gguf, default=ARCHITECTURES[config.architecture]
                                          .chat_template)
    except ChatTemplateError:
        return None
    try:
        template.caps  # noqa: B018 - probed now: a broken template is refused at load
    except ChatTemplateError as e:
        log.warning("%s: chat template refused (%s); chat requests are refused, raw "
                    "completions work", gguf.path.name, e)
        return None
    return template


def load_model(name: str, weights: str = "auto", moe: MoEOptions | None = None) -> LoadedModel:
    """Load ``name`` (alias or .gguf path), pulling a registered alias if needed.

    ``moe``: where a mixture-of-experts model keeps its experts (default: resident)."""
    start = time.perf_counter()
    path = ensure_model(name)
    gguf = GGUFFile(path)
    config = model_config(gguf)  # raises for unsupported architectures first
    weights = resolve_weights(weights)  # may build the native kernel: after cheap checks
    fmt = weight_format(weights).bind(gguf)
    tokenizer = Tokenizer.from_gguf(gguf)
    family = ARCHITECTURES[config.architecture]
    template = _chat_template(gguf, config)
    if moe is not None and moe.stream and not config.n_experts:
        log.warning("%s has no experts: --moe-stream ignored", path.name)
    elif moe is not None and not moe.stream and (moe.pilot or moe.pinned_share):
        log.warning("--moe-pilot and --moe-pinned-share act on streamed experts: ignored "
                    "without --moe-stream")
    try:
        model = family.model.from_gguf(gguf, config, fmt, moe)
    except (RuntimeError, ValueError) as e:
        # torch's and numpy's shape errors: the file's tensors do not fit the
        # configuration its own metadata gives (named by the message)
        raise GGUFError(f"{path.name}: its tensors do not fit its configuration: "
                        f"{type(e).__name__}: {e}") from None
    gguf.release_pages()
    gguf.drop_array_metadata()
    return LoadedModel(path, config, model, tokenizer, template, weights,
                       time.perf_counter() - start, tuple(p for p, _ in gguf.parts),
                       gguf.get(RERANK_TEMPLATE_KEY))


def physical_cores() -> int:
    """Physical cores available to this process (SMT siblings counted once)."""
    if hasattr(os, "sched_getaffinity"):
        cpus = os.sched_getaffinity(0)
    else:
        cpus = range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add((base.joinpath("physical_package_id").read_text().strip(),
                       base.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(cpu)))
    return max(1, len(cores))
