"""Embeddings: a text's final hidden states (after the model's output norm, as
llama.cpp's embeddings read them) pooled into one vector and L2-normalised.

How the states are pooled is the GGUF's ``{arch}.pooling_type``: ``mean`` over the
tokens, ``cls`` (the first token), ``last`` (the last token: decoder embedders such as
Qwen3-Embedding). A file that says nothing, as a chat model's does, gets ``last``, as
vLLM does for a decoder used as an embedder.

A :class:`Batcher` runs the inputs of every waiting request in passes of up to
:data:`PASS_TOKENS` tokens, one pass per engine step, beside generation. An input longer
than what is left of a pass is run in chunks over several passes, as a long prompt's
prefill is, so a pass costs about the same whatever the inputs and attention never spans
more than a chunk of queries at once. Keys and values go into a private pool that lives
while inputs are in progress and is dropped when none is: no KV outlives an input, and
nothing is written to the engine's cache. A row's vector does not depend on what shares
its pass (the batch-invariant kernels), which a test checks.
"""

from __future__ import annotations

import re
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.errors import EmberError
from ember.kv.blocks import BlockAllocator, BlockTable, blocks_for
from ember.models.layers.attention import AttentionBatch, RowSpec

PASS_TOKENS = 2048  # tokens per forward pass, by default (an engine thread uses its step's)
MAX_ROWS = 64  # inputs per pass (each may waste most of a KV block)
# llama.cpp's enum llama_pooling_type; "rank": a reranker's head over the last state
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
BLOCK_SIZE = 16
SOFTMAX_RANKERS = {"qwen3"}  # whose head outputs llama.cpp softmaxes (yes/no logits)


class EmbeddingCancelled(EmberError):
    """An embedding request dropped before it finished (its client left)."""


class EmbeddingError(EmberError):
    """A model or input that cannot give an embedding (``param`` names the culprit)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def input_ids(tokenizer: Any, text: str | list[int]) -> list[int]:
    """An input's tokens as llama.cpp's embeddings take them: BOS, EOS and SEP where the
    file (or its tokenizer model) asks for them; token ids as given."""
    if not isinstance(text, str):
        return list(text)
    ids = tokenizer.encode(text, add_bos=tokenizer.add_bos)
    if tokenizer.add_eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    if tokenizer.add_sep and tokenizer.sep_id is not None:  # BERT's [SEP]
        ids.append(tokenizer.sep_id)
    return ids


def pooling_of(cfg: Any) -> str:
    """The file's pooling (``last`` where it names none)."""
    raw = cfg.pooling_type
    if raw is None or raw == 0:
        return "last"
    try:
        return POOLING_TYPES[raw]
    except KeyError:
        raise EmbeddingError(f"{cfg.architecture}.pooling_type {raw} is not supported "
                             "(1 mean, 2 cls, 3 last, 4 rank)") from None


def is_reranker(model: Any) -> bool:
    return pooling_of(model.cfg) == "rank" and model.classifier is not None


def rerank_ids(tokenizer: Any, template: str | None, query: str, document: str) -> list[int]:
    """A (query, document) pair as a reranker reads it: the file's rerank template with
    both filled in (its control tokens count, none typed in the texts), else llama.cpp's
    plain pairing, each special as the file asks: BOS, the query, EOS (SEP where the
    vocabulary has no EOS), SEP, the document, EOS — ``[CLS] q [SEP] d`` for a BERT
    cross-encoder, ``<s> q </s></s> d </s>`` for a RoBERTa one."""
    if template is not None:
        segments: list[tuple[str, bool]] = []
        for i, part in enumerate(re.split(r"(\{query\}|\{document\})", template)):
            if i % 2:
                segments.append((query if part == "{query}" else document, False))
            elif part:
                segments.append((part, True))
        return tokenizer.encode_segments(segments)
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
    ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    ends = [eos] if tokenizer.add_eos and eos is not None else []
    sep = [tokenizer.sep_id] if tokenizer.add_sep and tokenizer.sep_id is not None else []
    return ids + tokenizer.encode(query) + ends + sep + tokenizer.encode(document) + ends


def embed(model: Any, inputs: list[list[int]], kv_dtype: Any = "f32",
          pass_tokens: int = PASS_TOKENS, scores: bool = False) -> list[torch.Tensor]:
    """One unit vector (float32, the model's hidden size) per input, in order, pooled
    as the model's file says: the passes a :class:`Batcher` makes, run to the end.
    ``scores``: a reranker's head outputs instead (see :func:`_output`)."""
    batcher, result = Batcher(kv_dtype, pass_tokens), Future()
    result.set_running_or_notify_cancel()
    batcher.add(model, inputs, result, scores)
    while batcher.pending:
        batcher.step(model)
    return result.result()


def check(model: Any, inputs: list[list[int]], scores: bool = False) -> None:
    """Refuse a model that cannot embed (or score), or an empty input, before any pass."""
    if scores and not is_reranker(model):
        raise EmbeddingError("the model is not a reranker (its file has no "
                             "pooling_type 4 with a classification head, cls.*)", "model")
    if not scores and pooling_of(model.cfg) == "rank":
        raise EmbeddingError("the model is a reranker: it scores pairs (/v1/rerank), "
                             "it gives no embeddings", "model")
    if model.cfg.delta_net is not None:
        raise EmbeddingError("embeddings from a hybrid (recurrent) model are not supported")
    for i, ids in enumerate(inputs):
        if not ids:
            raise EmbeddingError(f"input {i} is empty", "input")


@dataclass
class _Work:
    """One request: its inputs, how many have been started, their vectors by index."""

    inputs: list[list[int]]
    result: Future
    started: int = 0
    vectors: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Input:
    """An input in progress: ``done`` of its tokens have been through the model."""

    work: _Work
    index: int
    table: BlockTable
    done: int = 0
    pooled: torch.Tensor | None = None  # the sum (mean), or the state kept (cls, last)

    @property
    def ids(self) -> list[int]:
        return self.work.inputs[self.index]


class Batcher:
    """Embedding requests waiting on an engine thread (continuous batching). A pass
    first continues the input left unfinished by the last one, then takes the next input
    of every waiting request in turn, round after round, so that a short request that
    arrives behind a long one is done in the next pass. At most one input is
    unfinished between passes, which bounds the private pool by one context window."""

    def __init__(self, kv_dtype: Any = "f32", pass_tokens: int = PASS_TOKENS) -> None:
        self.kv_dtype, self.pass_tokens = kv_dtype, pass_tokens
        self._waiting: deque[_Work] = deque()
        self._cancelled: set[Future] = set()  # added from any thread (see cancel)
        self._partial: _Input | None = None
        self._pool: tuple[BlockAllocator, Any] | None = None  # (allocator, KV storage)

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    def add(self, model: Any, inputs: list[list[int]], result: Future,
            scores: bool = False) -> None:
        """Queue a request; ``scores``: a reranker's scores, not embeddings."""
        try:
            check(model, inputs, scores)
        except EmbeddingError as e:
            result.set_exception(e)
            return
        self._waiting.append(_Work(inputs, result))

    def cancel(self, result: Future) -> None:
        """Drop the request ``result`` belongs to before its next pass (its client left);
        callable from any thread. The future then holds :class:`EmbeddingCancelled`."""
        self._cancelled.add(result)

    def _drop_cancelled(self) -> None:
        for work in [w for w in self._waiting if w.result in self._cancelled]:
            self._waiting.remove(work)
            if self._partial is not None and self._partial.work is work:
                self._partial.table.release()
                self._partial = None
            work.result.set_exception(EmbeddingCancelled("the client left"))
        if not self._waiting:
            self._cancelled.clear()
            self._pool = None

    def step(self, model: Any) -> None:
        """One pass; settle every request whose inputs are all embedded."""
        self._drop_cancelled()
        if not self._waiting:
            return
        try:
            rows = self._plan(model)
            states = self._run(model, rows)
        except Exception as e:  # the model's (or memory's) fault, not one input's
            self.fail_all(e)
            return
        pooling, first = pooling_of(model.cfg), 0
        for row, n in rows:
            chunk = states[first:first + n].float()
            first += n
            _pool_chunk(row, chunk, pooling, model.cfg.causal)
            row.done += n
            if row.done < len(row.ids):
                self._partial = row
                continue
            if self._partial is row:
                self._partial = None
            row.table.release()
            row.work.vectors[row.index] = _output(model, row, pooling)
        for work in [w for w in self._waiting if len(w.vectors) == len(w.inputs)]:
            self._waiting.remove(work)
            work.result.set_result([work.vectors[i] for i in range(len(work.inputs))])
        if not self._waiting:
            self._pool = None

    def fail_all(self, error: BaseException) -> None:
        while self._waiting:
            self._waiting.popleft().result.set_exception(error)
        self._partial, self._pool = None, None

    # ------------------------------------------------------------ planning
    def _plan(self, model: Any) -> list[tuple[_Input, int]]:
        """The next pass: (input, how many of its tokens to run now)."""
        fresh = [w for w in self._waiting if w.started < len(w.inputs)]
        budget = self.pass_tokens
        rows: list[tuple[_Input, int]] = []
        if self._partial is not None:
            row = self._partial
            rows.append((row, min(len(row.ids) - row.done, budget // 2 if fresh else budget)))
            budget -= rows[0][1]
        causal = model.cfg.causal  # an encoder runs every input whole, keeping no KV
        picks = self._pick(fresh, budget, may_chunk=self._partial is None and causal,
                           whole=not causal)
        if self._partial is None:  # nothing in progress: a pool sized for this pass
            need = sum(blocks_for(len(w.inputs[i]), BLOCK_SIZE) for w, i, _ in picks)
            if any(n < len(w.inputs[i]) for w, i, n in picks):  # room to go on beside it
                need += blocks_for(self.pass_tokens, BLOCK_SIZE) + MAX_ROWS
            allocator = BlockAllocator(need)
            kv = model.new_kv_storage(need, BLOCK_SIZE, self.kv_dtype) if causal else None
            self._pool = (allocator, kv)
        assert self._pool is not None
        allocator, kv = self._pool
        for work, i, n in picks:
            table = BlockTable(allocator, BLOCK_SIZE)
            table.reserve(len(work.inputs[i]))  # all of it: a chunked input stays
            work.started = i + 1
            rows.append((_Input(work, i, table), n))
        # attention reads whole blocks: what it reads past a row's end must be zeros,
        # not the garbage (NaN, in f16) of new memory or a finished row's keys
        if kv is not None:
            kv.zero_blocks(allocator.take_unzeroed())
        return rows

    def _pick(self, fresh: list[_Work], budget: int, may_chunk: bool, whole: bool = False
              ) -> list[tuple[_Work, int, int]]:
        """Inputs not yet started, the next of each request in turn: (request, input,
        tokens now). The last may be cut to the budget (chunked) where ``may_chunk``;
        ``whole``: an input longer than the pass runs alone, whole (an encoder's);
        beside an input in progress, the others must fit the pool's free blocks."""
        free = self._pool[0].num_free if self._partial is not None and self._pool else None
        picks: list[tuple[_Work, int, int]] = []
        following = {id(w): w.started for w in fresh}
        while budget > 0 and len(picks) < MAX_ROWS:
            took = False
            for work in fresh:
                i = following[id(work)]
                if i == len(work.inputs):
                    continue
                n = len(work.inputs[i])
                if n > budget and not may_chunk:
                    if not (whole and not picks):
                        return picks
                    budget = n  # alone in its pass
                if free is not None:
                    free -= blocks_for(n, BLOCK_SIZE)
                    if free < 0:
                        return picks
                picks.append((work, i, min(n, budget)))
                following[id(work)] = i + 1
                budget -= picks[-1][2]
                took = True
                if budget == 0 or len(picks) == MAX_ROWS:
                    return picks
            if not took:
                break
        return picks

    def _run(self, model: Any, rows: list[tuple[_Input, int]]) -> torch.Tensor:
        """The final hidden states of the pass's tokens, row after row."""
        assert self._pool is not None
        specs = [RowSpec(row.table.block_ids(row.done + n), row.done, n) for row, n in rows]
        tokens = torch.tensor([t for row, n in rows for t in row.ids[row.done:row.done + n]])
        return model.hidden_states(tokens, AttentionBatch.build(specs, BLOCK_SIZE),
                                   self._pool[1])


def _output(model: Any, row: _Input, pooling: str) -> torch.Tensor:
    """An input's answer: its unit vector, or a reranker's head outputs (llama.cpp's
    rank pooling: the pooled state through the file's head, softmaxed for Qwen3, whose
    two outputs are its "yes" and "no" logits: the first is then P(yes); a
    cross-encoder's one output is its relevance logit)."""
    assert row.pooled is not None
    if pooling != "rank":
        vector = row.pooled / len(row.ids) if pooling == "mean" else row.pooled
        return torch.nn.functional.normalize(vector, dim=0)
    out = model.classifier(row.pooled)
    if model.cfg.architecture in SOFTMAX_RANKERS:
        out = torch.softmax(out, dim=0)
    return out


def _pool_chunk(row: _Input, states: torch.Tensor, pooling: str, causal: bool) -> None:
    """Fold a chunk's states into the row's pooled value (a reranker reads its last
    state, an encoder's cross-encoder its first, as llama.cpp's rank pooling)."""
    if pooling == "mean":
        total = states.sum(0)
        row.pooled = total if row.pooled is None else row.pooled + total
    elif pooling == "cls" or (pooling == "rank" and not causal):
        if row.done == 0:
            row.pooled = states[0]
    else:  # last, and a causal reranker's rank
        row.pooled = states[-1]
