"""``POST /v1/embeddings`` (OpenAI's shape) and Ollama's ``POST /api/embed``: the
inputs tokenized in a preparation thread, embedded on the engine's thread between
generation steps (:mod:`ember.engine.embedding`), rendered in each API's shape."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ember.engine import embedding
from ember.server import protocol as P
from ember.server.errors import APIError, unsupported

MAX_INPUTS = 2048  # OpenAI's limits on one request: its inputs, their tokens together
MAX_TOTAL_TOKENS = 300_000


def _ids_or_texts(value: Any, param: str) -> list[str | list[int]]:
    """OpenAI's ``input``: a string, a list of strings, token ids, or lists of ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in value):
        return [value]
    if isinstance(value, list) and value and all(
            isinstance(v, str) or (isinstance(v, list) and v and all(
                isinstance(t, int) and not isinstance(t, bool) for t in v)) for v in value):
        if len(value) > MAX_INPUTS:
            raise APIError(400, f"'{param}' holds {len(value)} inputs; at most {MAX_INPUTS}",
                           param=param)
        return list(value)
    raise APIError(400, f"'{param}' must be a non-empty string, list of strings, list of "
                   "token ids or list of lists of token ids", param=param)


@dataclass(frozen=True)
class Prepared:
    """A parsed embeddings body and its inputs' tokens."""

    body: Any
    ids: list[list[int]]


class EmbeddingsRequest(P._Body):
    model: str
    input: Any
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def validate_request(self) -> None:
        self.reject_extra()
        if self.encoding_format not in ("float", "base64"):
            raise unsupported("encoding_format", f"{self.encoding_format!r} is not supported "
                              "(float or base64)")
        self.inputs()

    scores: ClassVar[bool] = False

    def inputs(self) -> list[str | list[int]]:
        return _ids_or_texts(self.input, "input")

    def input_ids(self, engine: Any) -> list[list[int]]:
        # OpenAI refuses an input longer than the model takes
        return input_ids(engine, self.inputs(), truncate=False)


def input_ids(engine: Any, inputs: list[str | list[int]], truncate: bool
              ) -> list[list[int]]:
    """Each input's tokens (in a preparation thread): texts tokenized as llama.cpp's
    embeddings take them, ids checked against the vocabulary; an input longer than the
    context window is cut to it where ``truncate`` (Ollama's default), else a 400."""
    vocab, limit = engine.tokenizer.vocab_size, engine.max_model_len
    out = []
    for i, item in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            ids = embedding.input_ids(engine.tokenizer, item)
        else:
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"'{param}' holds {bad}, not a token id (0..{vocab - 1})",
                               param=param)
            ids = list(item)
        if not ids:
            raise APIError(400, f"'{param}' is empty", param=param)
        if len(ids) > limit:
            if not truncate:
                raise APIError(400, f"'{param}' is {len(ids)} tokens long; the context "
                               f"window is {limit} tokens", param=param,
                               code="context_length_exceeded")
            ids = ids[:limit]
        out.append(ids)
    return _capped(out, "input")


def _capped(ids: list[list[int]], param: str) -> list[list[int]]:
    total = sum(map(len, ids))
    if total > MAX_TOTAL_TOKENS:
        raise APIError(400, f"'{param}' holds {total} tokens in all; at most "
                       f"{MAX_TOTAL_TOKENS} per request", param=param)
    return ids


class OllamaEmbedRequest(P._Body):
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None

    def validate_request(self) -> None:
        self.reject_extra()
        if not self.input:
            raise APIError(400, "input: must not be empty", param="input")

    scores: ClassVar[bool] = False

    def inputs(self) -> list[str | list[int]]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    def input_ids(self, engine: Any) -> list[list[int]]:
        return input_ids(engine, self.inputs(), self.truncate)


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class RerankRequest(P._Body):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    scores: ClassVar[bool] = True

    def validate_request(self) -> None:
        self.reject_extra()

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def input_ids(self, engine: Any) -> list[list[int]]:
        """Each (query, document) pair as the reranker reads it; a pair longer than the
        context window is a 400 naming its document."""
        loaded, limit = engine.loaded, engine.max_model_len
        out = []
        for i, text in enumerate(self.texts()):
            ids = embedding.rerank_ids(loaded.tokenizer, loaded.rerank_template,
                                       self.query, text)
            if len(ids) > limit:
                raise APIError(400, f"'documents[{i}]' with the query is {len(ids)} tokens "
                               f"long; the context window is {limit} tokens",
                               param=f"documents[{i}]", code="context_length_exceeded")
            out.append(ids)
        return _capped(out, "documents")


def check_dimensions(dimensions: int | None, hidden: int) -> None:
    """Refuse ``dimensions`` above the model's embedding size (before any compute)."""
    if dimensions is not None and dimensions > hidden:
        raise APIError(400, f"'dimensions' ({dimensions}) exceeds the model's embedding size "
                       f"({hidden})", param="dimensions")


def shortened(vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first ``dimensions`` of a unit vector, made unit again (a Matryoshka model's
    shorter embedding; checked by :func:`check_dimensions`)."""
    if dimensions is None:
        return vector
    return torch.nn.functional.normalize(vector[:dimensions], dim=0)


def openai_body(req: EmbeddingsRequest, vectors: list[torch.Tensor], prompt_tokens: int
                ) -> dict[str, Any]:
    data = []
    for i, v in enumerate(vectors):
        if req.encoding_format == "base64":
            value: Any = base64.b64encode(v.numpy().astype(np.float32).tobytes()).decode()
        else:
            value = v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def rerank_body(req: RerankRequest, outputs: list[torch.Tensor], prompt_tokens: int
                ) -> dict[str, Any]:
    """Results by relevance, highest first, ``top_n`` of them (llama.cpp's server reads a
    reranker's first output as the score; Qwen3-Reranker's is P(yes))."""
    texts = req.texts()
    results = []
    for i, out in enumerate(outputs):
        result: dict[str, Any] = {"index": i, "relevance_score": float(out[0])}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    results.sort(key=lambda r: -r["relevance_score"])
    return {"model": req.model, "object": "list", "results": results[:req.top_n],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def ollama_body(req: OllamaEmbedRequest, vectors: list[torch.Tensor], prompt_tokens: int,
                nanoseconds: int) -> dict[str, Any]:
    return {"model": req.model, "embeddings": [v.tolist() for v in vectors],
            "total_duration": nanoseconds, "load_duration": 0,
            "prompt_eval_count": prompt_tokens}
