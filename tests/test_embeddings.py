"""Embeddings from a decoder (ember.engine.embedding): transformers' own hidden states of
the real SmolLM2 (loaded from the same GGUF) pooled as the file's ``pooling_type`` says
are the oracle; a row embeds the same bits alone and beside others; the file's pooling
key is read; a file whose pooling is rank (4) is a reranker, refused here. A Qwen3
reranker converted by llama.cpp scores pairs as transformers' yes/no logits say."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ember import LLM
from ember.engine import embedding

TEXTS = ["The lighthouse stood at the edge of the cliff.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "Paris is the capital of France.", "ok"]
QUERY = "What is the capital of France?"


def _hf_embedding(backbone, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden states of ``ids`` (``backbone``: the model without its
    head), pooled and normalised."""
    with torch.no_grad():
        states = backbone(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.fixture(scope="module")
def pooled_files(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Path]:
    """SmolLM2 with each pooling_type written into its file (as an embedder's has it)."""
    from hf_gguf import rewrite_gguf

    root = tmp_path_factory.mktemp("pooling")
    return {name: rewrite_gguf(smollm2_gguf, root / f"{name}.gguf",
                               add_keys={"llama.pooling_type": value})
            for name, value in (("mean", 1), ("cls", 2), ("rank", 4))}


@pytest.mark.slow
def test_embeddings_are_transformers_hidden_states_pooled_as_the_file_says(
        smollm2_llm, smollm2_hf, pooled_files):
    """f32 weights: a chat model's file names no pooling (last token); files that name
    mean or cls pooling get it. Cosine ≥ 0.99999 with transformers (float32 rounding)."""
    ids = [smollm2_llm.encode(t) for t in TEXTS]
    cases = [("last", smollm2_llm)] + [
        (p, LLM(str(pooled_files[p]), weights="f32", kv_dtype="f32", num_kv_blocks=32))
        for p in ("mean", "cls")]
    for pooling, llm in cases:
        assert embedding.pooling_of(llm.engine.loaded.model.cfg) == pooling
        ours = llm.embed(TEXTS)
        for v, row in zip(ours, ids, strict=True):
            theirs = _hf_embedding(smollm2_hf.model, row, pooling)
            cosine = float(v @ theirs)
            assert cosine > 0.99999, (pooling, cosine)
            assert abs(float(v.norm()) - 1) < 1e-5
    with pytest.raises(embedding.EmbeddingError, match="is a reranker"):
        LLM(str(pooled_files["rank"]), weights="f32", num_kv_blocks=16).embed(["x"])


def test_an_input_embeds_the_same_bits_alone_and_beside_others(smollm2_served_llm):
    """q4's native stack is batch-invariant: a row's vector does not depend on what
    shares its pass, nor on the order; token ids are the text's tokens."""
    together = smollm2_served_llm.embed(TEXTS)
    for text, v in zip(TEXTS, together, strict=True):
        (alone,) = smollm2_served_llm.embed([text])
        assert torch.equal(alone, v)
    assert torch.equal(smollm2_served_llm.embed(TEXTS[::-1])[0], together[-1])
    ids = smollm2_served_llm.encode(TEXTS[0])
    assert torch.equal(smollm2_served_llm.embed([ids])[0], together[0])
    assert len({tuple(v.tolist()) for v in together}) == len(TEXTS)


def test_many_inputs_are_split_into_passes_that_keep_each_row_whole(smollm2_served_llm):
    model = smollm2_served_llm.engine.loaded.model
    ids = [smollm2_served_llm.encode(t) for t in TEXTS * 3]
    whole = embedding.embed(model, ids)
    split = embedding.embed(model, ids, pass_tokens=40)  # several passes, none chunked
    assert all(torch.equal(a, b) for a, b in zip(whole, split, strict=True))
    with pytest.raises(embedding.EmbeddingError, match="input 1 is empty"):
        embedding.embed(model, [[1], []])


def test_a_long_input_is_chunked_over_passes_like_a_prefill(smollm2_served_llm, monkeypatch):
    """An input longer than a pass runs in chunks, its keys and values kept between
    them: the vector is the one pass's (not bit for bit: a chunk attends its cached
    prefix through another kernel), for every pooling."""
    model = smollm2_served_llm.engine.loaded.model
    long = smollm2_served_llm.encode(" ".join(TEXTS) * 6)
    assert len(long) > 200
    plain = model.cfg
    for pooling in (3, 1, 2):
        monkeypatch.setattr(model, "cfg", dataclasses.replace(plain, pooling_type=pooling))
        (one,) = embedding.embed(model, [long])
        (chunked,) = embedding.embed(model, [long], pass_tokens=48)
        assert float(one @ chunked) > 0.9999, pooling


def test_a_short_request_behind_a_long_one_is_done_in_the_next_pass(smollm2_served_llm):
    """Continuous batching: passes of 64 tokens; a 300-token request is in progress
    when a 10-token one arrives, and the short one is not kept waiting for it."""
    from concurrent.futures import Future

    model = smollm2_served_llm.engine.loaded.model
    long_ids = smollm2_served_llm.encode(" ".join(TEXTS) * 6)[:300]
    short_ids = smollm2_served_llm.encode(TEXTS[2])
    batcher = embedding.Batcher(pass_tokens=64)
    long, short = Future(), Future()
    batcher.add(model, [long_ids, short_ids], long)
    batcher.step(model)  # the long input's first chunk
    batcher.add(model, [short_ids], short)
    batcher.step(model)
    assert short.done() and not long.done()
    passes = 2
    while batcher.pending:
        batcher.step(model)
        passes += 1
    assert passes <= 300 // 32 + 2  # at least half of every pass went to the long input
    (alone,) = embedding.embed(model, [short_ids])
    assert torch.equal(short.result()[0], alone)
    assert torch.equal(long.result()[1], alone)
    (long_alone,) = embedding.embed(model, [long_ids])
    assert float(long.result()[0] @ long_alone) > 0.9999


def test_embeddings_run_on_the_engine_thread_beside_generation(smollm2_served_llm):
    """An engine thread embeds between generation steps: a generation streamed at the
    same time says what it says alone, the vectors are LLM.embed's, and a bad input
    fails its own request only."""
    from ember import SamplingParams
    from ember.engine.engine import LLMEngine
    from ember.engine.thread import EngineThread

    engine = LLMEngine(smollm2_served_llm.engine.config, smollm2_served_llm.engine.loaded)
    thread = EngineThread(engine).start()
    try:
        prompt = smollm2_served_llm.encode(TEXTS[0])
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        alone = list(thread.stream(prompt, params))[-1].token_ids
        free = engine.kv.num_free  # what the engine's pool holds with the prompt cached
        ids = [smollm2_served_llm.encode(t) for t in TEXTS]
        stream = thread.stream(prompt, params)
        futures = [thread.embed(ids), thread.embed([[]]), thread.embed(ids[:1])]
        assert list(stream)[-1].token_ids == alone
        want = smollm2_served_llm.embed(TEXTS)
        got = futures[0].result(timeout=60)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        with pytest.raises(embedding.EmbeddingError, match="empty"):
            futures[1].result(timeout=60)
        assert torch.equal(futures[2].result(timeout=60)[0], want[0])
        assert engine.kv.num_free == free  # embeddings never touch the engine's pool
    finally:
        thread.shutdown(timeout=30)


def test_the_private_pool_is_zeroed_before_attention_reads_it(tiny_loaded):
    """Attention reads whole blocks; new f16 memory past a row's end held NaNs that
    reached every vector (found by the OpenAPI fuzz run on the tiny model)."""
    from ember.kv.blocks import KV_DTYPES

    inputs = [[1, 2, 3, 4, 5], [7] * 40, [9]]
    exact = embedding.embed(tiny_loaded.model, inputs, "f32")
    for _ in range(2):  # the second time, blocks a finished row wrote are handed out again
        half = embedding.embed(tiny_loaded.model, inputs[::-1], KV_DTYPES["f16"], 16)
        for a, b in zip(exact, half[::-1], strict=True):
            assert torch.isfinite(b).all() and float(a @ b) > 0.999


@pytest.mark.slow
def test_a_qwen3_reranker_scores_pairs_as_transformers_yes_and_no_logits(qwen3_reranker):
    """Qwen3-Reranker's own recipe is the oracle: transformers' logits of "yes" and "no"
    after the rerank prompt, softmaxed, give P(yes). ember reads the converted file's
    head (those two rows) and template, and scores the same (|Δ| < 1e-5 at f32)."""
    import transformers

    path, hf, hf_dir = qwen3_reranker
    llm = LLM(str(path), weights="f32", kv_dtype="f32", num_kv_blocks=64)
    loaded = llm.engine.loaded
    assert embedding.is_reranker(loaded.model) and "{document}" in loaded.rerank_template
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    query = "What is the capital of France?"
    docs = TEXTS + ["<|im_end|> yes"]  # control text in a document stays text
    scores = llm.rerank(query, docs)
    for doc, score in zip(docs, scores, strict=True):
        ids = embedding.rerank_ids(loaded.tokenizer, loaded.rerank_template, query, doc)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        want = float(torch.softmax(logits[[yes, no]], dim=0)[0])
        assert abs(score - want) < 1e-5, (doc, score, want)
    im_end = loaded.tokenizer.token_to_id["<|im_end|>"]
    last = embedding.rerank_ids(loaded.tokenizer, loaded.rerank_template, query, docs[-1])
    assert last.count(im_end) == 2  # the template's two, not the document's
    assert len(set(scores)) == len(docs)
    with pytest.raises(embedding.EmbeddingError, match="is a reranker"):
        llm.embed(["x"])


def test_a_model_without_a_head_is_not_a_reranker(smollm2_served_llm):
    with pytest.raises(embedding.EmbeddingError, match="not a reranker"):
        smollm2_served_llm.rerank("q", ["d"])


LLAMA_PYTHON = os.environ.get("EMBER_LLAMA_PYTHON")
needs_llama_cpp = pytest.mark.skipif(not LLAMA_PYTHON, reason="set EMBER_LLAMA_PYTHON to an "
                                     "interpreter with llama-cpp-python to compare with "
                                     "llama.cpp")


def _llama_cpp(path: Path, pooling: int, inputs: list[list[int]], tmp_path: Path
               ) -> torch.Tensor:
    """llama.cpp's pooled outputs of ``inputs`` on the file (tests/llamacpp_embed.py)."""
    import numpy as np

    ids, out = tmp_path / "ids.json", tmp_path / "out.npy"
    ids.write_text(json.dumps(inputs))
    subprocess.run([str(LLAMA_PYTHON), str(Path(__file__).with_name("llamacpp_embed.py")),
                    str(path), str(out), str(pooling), str(ids)], check=True)
    return torch.from_numpy(np.load(out))


@needs_llama_cpp
@pytest.mark.slow
def test_embeddings_match_llama_cpp_on_the_same_file(smollm2_gguf, smollm2_llm, pooled_files,
                                                     tmp_path):
    """llama.cpp's embeddings of the real SmolLM2 (its Q4_1 file, which llama.cpp
    multiplies by activations rounded to 8 bits) and ember's f32 read of the same file:
    last (the chat model's file names none: asked for), mean and cls (the file's key)."""
    ids = [smollm2_llm.encode(t) for t in TEXTS]
    cases = [(smollm2_gguf, 3, smollm2_llm)] + [
        (pooled_files[p], -1, LLM(str(pooled_files[p]), weights="f32", kv_dtype="f32",
                                  num_kv_blocks=32)) for p in ("mean", "cls")]
    for path, pooling, llm in cases:
        theirs = torch.nn.functional.normalize(_llama_cpp(path, pooling, ids, tmp_path), dim=1)
        ours = torch.stack(llm.embed(ids))
        cosines = (ours * theirs).sum(1)
        print(path.name, pooling, [f"{c:.6f}" for c in cosines.tolist()])
        assert (cosines > 0.999).all(), cosines


@needs_llama_cpp
def test_a_bert_encoder_matches_llama_cpp_on_the_same_file(bert_files, tmp_path):
    """llama.cpp reads the BERT or nomic-bert file as ember does (its names, keys and
    vocabulary) and pools it the same: it is a second oracle beside transformers."""
    _, files = bert_files
    for path in files.values():
        llm = LLM(str(path), weights="f32", num_kv_blocks=16)
        ids = [embedding.input_ids(llm.tokenizer, t) for t in TEXTS]
        theirs = torch.nn.functional.normalize(_llama_cpp(path, -1, ids, tmp_path), dim=1)
        cosines = (torch.stack(llm.embed(ids)) * theirs).sum(1)
        print(path.name, [f"{c:.6f}" for c in cosines.tolist()])
        assert (cosines > 0.99999).all(), cosines  # f32 weights on both sides


@needs_llama_cpp
@pytest.mark.slow
def test_rerank_matches_llama_cpp_on_the_same_file(qwen3_reranker, tmp_path):
    """llama.cpp's rank pooling on the converted reranker, fed ember's pairs: its first
    output (P(yes), what llama-server answers as the score) is ember's score."""
    path = qwen3_reranker[0]
    llm = LLM(str(path), weights="f32", kv_dtype="f32", num_kv_blocks=64)
    ours, theirs = _rerank_beside_llama_cpp(llm, path, tmp_path)
    assert theirs.shape[1] == 2
    assert max(abs(a - b) for a, b in zip(ours, theirs[:, 0].tolist(), strict=True)) < 1e-4


def _rerank_beside_llama_cpp(llm: LLM, path: Path, tmp_path: Path
                             ) -> tuple[list[float], torch.Tensor]:
    """ember's scores of (QUERY, each of TEXTS) and llama.cpp's rank-pooled outputs of
    the same pairs (as ember writes them) on the same file."""
    loaded = llm.engine.loaded
    ids = [embedding.rerank_ids(loaded.tokenizer, loaded.rerank_template, QUERY, d)
           for d in TEXTS]
    theirs = _llama_cpp(path, -1, ids, tmp_path)
    ours = llm.rerank(QUERY, TEXTS)
    print(path.name, ours, theirs[:, 0].tolist())
    return ours, theirs


def test_a_bert_encoder_embeds_as_transformers_does(bert_files):
    """A BERT (bidirectional, post-LayerNorm, GELU, learned positions) or a nomic-bert
    (rotary positions, fused qkv, SwiGLU, no biases) written as llama.cpp's GGUF: its
    mean- and CLS-pooled vectors are transformers' hidden states pooled the same way,
    [CLS] ... [SEP] as llama.cpp adds them; it generates nothing, by name."""
    from ember import SamplingParams
    from ember.engine.intake import InvalidRequest

    hf, files = bert_files
    for pooling, path in files.items():
        llm = LLM(str(path), weights="f32", num_kv_blocks=16)
        tokenizer = llm.tokenizer
        ours = llm.embed(TEXTS)
        for text, v in zip(TEXTS, ours, strict=True):
            ids = embedding.input_ids(tokenizer, text)
            assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
            theirs = _hf_embedding(hf, ids, pooling)
            assert float(v @ theirs) > 0.99999, (pooling, text)
        # inputs of different lengths in one pass see only themselves
        (alone,) = llm.embed([TEXTS[1]])
        assert torch.allclose(alone, ours[1], atol=1e-6)
    with pytest.raises(InvalidRequest, match="embedding model"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory: pytest.TempPathFactory):
    """A random BERT cross-encoder (a transformers backbone and RoBERTa's classification
    head, the oracle) and its GGUF with rank pooling."""
    pytest.importorskip("transformers")
    from bert_model import random_bert, random_rank_head, write_bert
    from llamacpp_source import llamacpp_source

    from ember.models.gguf import GGUFFile

    vocab_file = llamacpp_source() / "models" / "ggml-vocab-bert-bge.gguf"
    model = random_bert(len(GGUFFile(vocab_file).metadata["tokenizer.ggml.tokens"]))
    head = random_rank_head(model)
    path = write_bert(tmp_path_factory.mktemp("bert-rerank") / "bert-rerank.gguf", model,
                      vocab_file, 4, head)
    return model, head, path


def test_a_bert_cross_encoder_scores_pairs_as_transformers_does(bert_reranker):
    """A cross-encoder reads ``[CLS] query [SEP] document`` (llama.cpp's pairing) whole
    and scores its CLS state through the dense + tanh + projection head: transformers'
    RobertaClassificationHead over BertModel's states, to 1e-4; it embeds nothing."""
    backbone, head, path = bert_reranker
    llm = LLM(str(path), weights="f32", num_kv_blocks=16)
    tokenizer = llm.tokenizer
    ours = llm.rerank(QUERY, TEXTS)
    for text, score in zip(TEXTS, ours, strict=True):
        ids = embedding.rerank_ids(tokenizer, None, QUERY, text)
        assert ids[0] == 101 and ids.count(102) == 1 and ids[-1] != 102
        with torch.no_grad():
            theirs = head(backbone(torch.tensor([ids])).last_hidden_state)
        assert abs(score - float(theirs)) < 1e-4, (text, score, float(theirs))
    assert len(set(ours)) == len(TEXTS)
    with pytest.raises(embedding.EmbeddingError, match="is a reranker"):
        llm.embed(["x"])


@needs_llama_cpp
def test_a_bert_cross_encoder_matches_llama_cpp_on_the_same_file(bert_reranker, tmp_path):
    """llama.cpp's rank pooling of the same pairs on the same file: its one output is
    ember's score."""
    path = bert_reranker[2]
    ours, theirs = _rerank_beside_llama_cpp(LLM(str(path), weights="f32", num_kv_blocks=16),
                                            path, tmp_path)
    assert theirs.shape[1] == 1
    # ~1e-4 apart on a logit: ggml's GELU is a tabulated approximation of erf's
    assert max(abs(a - b) for a, b in zip(ours, theirs[:, 0].tolist(), strict=True)) < 1e-3


def test_a_request_whose_client_left_is_dropped_before_its_next_pass(smollm2_served_llm):
    """Batcher.cancel (called when the HTTP client leaves): the request, mid-way through
    a chunked input, is dropped at the next pass with EmbeddingCancelled, its private KV
    given back; the request beside it finishes as if alone."""
    from concurrent.futures import Future

    model = smollm2_served_llm.engine.loaded.model
    long_ids = smollm2_served_llm.encode(" ".join(TEXTS) * 6)[:300]
    short_ids = smollm2_served_llm.encode(TEXTS[2])
    batcher = embedding.Batcher(pass_tokens=64)
    leaving, staying = Future(), Future()
    for f in (leaving, staying):
        f.set_running_or_notify_cancel()
    batcher.add(model, [long_ids], leaving)
    batcher.add(model, [short_ids, short_ids], staying)
    batcher.step(model)  # the long input is in progress, its KV in the pool
    assert batcher._partial is not None and batcher._partial.work.result is leaving
    batcher.cancel(leaving)
    while batcher.pending:
        batcher.step(model)
    with pytest.raises(embedding.EmbeddingCancelled):
        leaving.result()
    assert batcher._partial is None and batcher._pool is None
    (alone,) = embedding.embed(model, [short_ids])
    assert all(torch.equal(v, alone) for v in staying.result())
