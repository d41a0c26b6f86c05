"""LLM: the offline Python API — batched generate, streaming, and chat."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ember.config import EngineConfig
from ember.engine import embedding
from ember.engine.engine import LLMEngine
from ember.engine.output import RequestOutput
from ember.kv import conversation
from ember.kv.blocks import KV_DTYPES
from ember.kv.tier import blocks_of
from ember.models.loader import LoadedModel
from ember.models.registry import DEFAULT_MODEL
from ember.sampling.params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """A model plus an engine, driven synchronously from the caller's thread.

    >>> llm = LLM("smollm2-135m")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    >>> out[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, loras: dict[str, str | Path] | None = None,
                 loaded: LoadedModel | None = None, **options: Any) -> None:
        """``loras``: LoRA adapters to load, by name (GGUF files or PEFT directories);
        a request uses one with ``lora="NAME"``. ``loaded``: the model ``model`` names,
        already loaded (:func:`ember.models.loader.load_model`) — engines may share one."""
        self.engine = LLMEngine(EngineConfig(model=model, **options), loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self.chat_template = self.engine.loaded.chat_template
        for name, path in (loras or {}).items():
            self.load_lora(name, path)

    # ------------------------------------------------------------ adapters
    def load_lora(self, name: str, path: str | Path) -> None:
        """Load a LoRA adapter (GGUF file or PEFT directory) as ``name``; refused with a
        message naming what does not fit the base model."""
        self.engine.load_lora(name, str(path))

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    # ------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt) -> list[int]:
        """Raw text gets the model's BOS if its GGUF asks for it; token ids pass through."""
        return self.engine.loaded.encode_prompt(prompt)  # type: ignore[arg-type]

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Render the chat template; its control tokens (and none typed in messages) count."""
        return self.engine.loaded.encode_chat(messages, add_generation_prompt)

    # ------------------------------------------------------------ embeddings
    def embed(self, inputs: Sequence[Prompt]) -> list[torch.Tensor]:
        """One L2-normalised embedding (float32, the hidden size) per text or list of
        token ids, pooled as the model's file says (:mod:`ember.engine.embedding`)."""
        return embedding.embed(self.engine.loaded.model,
                               [embedding.input_ids(self.tokenizer, p) for p in inputs],
                               KV_DTYPES[self.engine.config.kv_dtype])

    def rerank(self, query: str, documents: Sequence[str]) -> list[float]:
        """A reranker's relevance score of each document for ``query`` (Qwen3-Reranker:
        P("yes")), in the documents' order; the pair built by the file's rerank template."""
        loaded = self.engine.loaded
        ids = [embedding.rerank_ids(self.tokenizer, loaded.rerank_template, query, d)
               for d in documents]
        outputs = embedding.embed(loaded.model, ids, KV_DTYPES[self.engine.config.kv_dtype],
                                  scores=True)
        return [float(out[0]) for out in outputs]

    # ------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched together; outputs in prompt order. ``lora``
        names a loaded adapter to run them with (default: the base model)."""
        batch = _as_prompt_list(prompts)
        return self._run([self.encode(p) for p in batch], sampling_params, tenant, lora)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation or several (a list of message lists)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([self.encode_chat(m) for m in convs], sampling_params, tenant, lora)

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield outputs as text arrives; each has the new ``delta_text``."""
        return self.stream_ids(self.encode(prompt), sampling_params, tenant, lora)

    def stream_ids(
        self, prompt_ids: list[int], sampling_params: SamplingParams | None = None,
        tenant: str | None = None, lora: str | None = None,
    ) -> Iterator[RequestOutput]:
        req = self.engine.add_request(prompt_ids, sampling_params or SamplingParams(),
                                      tenant=tenant, lora=lora)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if not req.is_finished:  # the consumer stopped early (e.g. Ctrl-C)
                self.engine.abort(req.request_id)
                self.engine.step()

    # ------------------------------------------------------------ KV files
    def save_prefix(self, tokens: Prompt, path: str | Path, tenant: str | None = None,
                    lora: str | None = None) -> int:
        """Write the KV of ``tokens``' full blocks (computed with adapter ``lora``, if
        given) to a new conversation file at ``path`` (computing what is not cached);
        returns how many tokens it holds."""
        ids = self.encode(tokens)
        # computes what the cache lacks (a hit costs the last token) and caches it
        self._run([ids], SamplingParams(max_tokens=1), tenant, lora)
        records = self.engine.export_prefix(ids, tenant, lora)
        Path(path).unlink(missing_ok=True)
        return conversation.append(path, self.engine.kv_fingerprint(),
                                   conversation.Conversation(), None, records).num_tokens

    def load_prefix(self, path: str | Path, tenant: str | None = None,
                    lora: str | None = None) -> list[int]:
        """Cache the KV in a file from :meth:`save_prefix` (or ``ember chat
        --conversation``); returns the tokens it covers — a prompt that starts with them
        skips their prefill. Raises ConversationError for another model's file. Blocks
        computed with another adapter than ``lora`` (or none) are not taken: 0 tokens."""
        conv = conversation.read(path, self.engine.kv_fingerprint())
        n = self.engine.import_prefix(conv.records, tenant, lora)
        return [t for rec in blocks_of(conv.records) for t in rec.tokens][:n]

    def _run(
        self,
        prompt_ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        tenant: str | None,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(prompt_ids))
        reqs = [self.engine.add_request(ids, p, tenant=tenant, lora=lora)
                for ids, p in zip(prompt_ids, params, strict=True)]
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(reqs):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
        finally:
            for r in reqs:
                if r.request_id not in results:
                    self.engine.abort(r.request_id)
            if len(results) < len(reqs):
                self.engine.step()
        return [results[r.request_id] for r in reqs]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)
