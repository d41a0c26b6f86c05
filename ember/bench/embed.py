"""``ember bench embed``: embeddings per second from ``ember serve``'s ``/v1/embeddings``
beside llama.cpp's ``llama-server --embedding`` on the same file, in one run.

Each server runs alone (one after the other, never both at once: on a small machine a
second process distorts every figure) with the same threads, and gets the same
requests: batches of N inputs of exactly T token ids each (random ids from the
vocabulary's ordinary tokens, sent as ids so that both run the very same tokens), one
request at a time, a warm-up first, then ``reps`` timed requests. A figure is N divided
by the median request time: what a client sees, HTTP and JSON included on both sides.
llama-server runs with as many slots as the largest batch (its continuous batching
over slots), a context of slots x (T + 16), a KV region per slot, ubatches of 512
tokens, pooling as the file says.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ember.bench.server_process import ServerProcess, free_port
from ember.bench.spec import LlamaServer

BERT_BASE = {"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072, "context": 512}


def write_bert_base(path: Path, seed: int = 0) -> Path:
    """A random-weight BERT-base-shaped encoder (12 layers of 768, F16 matrices, mean
    pooling) with SmolLM2's tokenizer (its 49,152-token table stands in for BERT's
    30,522: a lookup, not a matmul); the bench sends token ids, so the vocabulary's kind
    does not matter. Written to ``path.partial`` and renamed when complete."""
    import gguf
    import numpy as np

    from ember.bench.moe_model import copy_tokenizer
    from ember.models.gguf import GGUFFile
    from ember.models.registry import DEFAULT_MODEL, ensure_model

    b = BERT_BASE
    source = GGUFFile(ensure_model(DEFAULT_MODEL))
    vocab = len(source.metadata["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    partial = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(partial), "bert")
    w.add_context_length(b["context"])
    w.add_embedding_length(b["hidden"])
    w.add_feed_forward_length(b["ffn"])
    w.add_head_count(b["heads"])
    w.add_block_count(b["layers"])
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    copy_tokenizer(w, source)
    w.add_token_type_count(2)  # llama.cpp refuses a BERT without it
    eos = int(source.metadata["tokenizer.ggml.eos_token_id"])
    w.add_sep_token_id(eos)  # a BERT's [SEP] and [CLS]: llama.cpp reads both
    w.add_uint32("tokenizer.ggml.cls_token_id", int(source.metadata["tokenizer.ggml.bos_token_id"]))

    def matrix(name: str, rows: int, cols: int, dtype: Any = np.float16) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(dtype))

    def vector(name: str, n: int, center: float) -> None:
        w.add_tensor(name, (center + 0.02 * rng.standard_normal(n)).astype(np.float32))

    h, f = b["hidden"], b["ffn"]
    matrix("token_embd.weight", vocab, h)
    # added, not multiplied: F32, as llama.cpp's converter writes them (ggml adds no F16)
    matrix("position_embd.weight", b["context"], h, np.float32)
    matrix("token_types.weight", 2, h, np.float32)
    vector("token_embd_norm.weight", h, 1.0)
    vector("token_embd_norm.bias", h, 0.0)
    for i in range(b["layers"]):
        for name, rows, cols in (("attn_q", h, h), ("attn_k", h, h), ("attn_v", h, h),
                                 ("attn_output", h, h), ("ffn_up", f, h), ("ffn_down", h, f)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
            vector(f"blk.{i}.{name}.bias", rows, 0.0)
        for name in ("attn_output_norm", "layer_output_norm"):
            vector(f"blk.{i}.{name}.weight", h, 1.0)
            vector(f"blk.{i}.{name}.bias", h, 0.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    partial.replace(path)
    return path


def _inputs(vocab: int, batch: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = 300, min(vocab, 100_000) - 1  # ordinary tokens, clear of control ones
    return [[rng.randint(low, high) for _ in range(tokens)] for _ in range(batch)]


def _time(url: str, model: str, batches: dict[int, list[list[int]]], reps: int,
          headers: dict[str, str] | None = None) -> dict[int, float]:
    """Embeddings per second at each batch size (N / median request seconds)."""
    out = {}
    with httpx.Client(timeout=3600, headers=headers) as client:
        for n, inputs in batches.items():
            body = {"model": model, "input": inputs, "encoding_format": "float"}
            client.post(f"{url}/v1/embeddings", json=body).raise_for_status()  # warm-up
            seconds = []
            for _ in range(reps):
                start = time.perf_counter()
                reply = client.post(f"{url}/v1/embeddings", json=body)
                seconds.append(time.perf_counter() - start)
                reply.raise_for_status()
                assert len(reply.json()["data"]) == n
            out[n] = n / statistics.median(seconds)
    return out


def _llama_cpp(binary: str, gguf: Path, threads: int, pooling: int | None,
               inputs: dict[int, list[list[int]]], tokens: int, reps: int
               ) -> tuple[dict[int, float], list[str]]:
    """llama-server's figures, with as many slots as the largest batch. Its default
    weight repacking (the extra CPU buffer types: AMX, x8 repack) is tried first; where
    the server does not start with it (on an AMX machine its embedding warm-up crashes),
    the run is repeated with ``--no-repack``, and the flags used are returned."""
    slots = max(inputs)
    # each slot its own KV (no unified pool): a sequence attends its own 128 positions,
    # not a mask over every slot's; ubatches of 512 tokens (llama-server's default). Of
    # the configurations tried on batch 16 (unified or not, ubatch 512 or batch x T,
    # 4 or 16 slots) this one was llama.cpp's fastest.
    flags = ["--embedding", "--pooling", {1: "mean", 2: "cls", 4: "rank"}.get(pooling or 3,
                                                                               "last"),
             "-b", "2048", "-ub", "512", "--no-kv-unified"]
    for extra in ([], ["--no-repack"]):
        server = LlamaServer(binary, gguf, threads, slots, flags + extra,
                             context=slots * (tokens + 16))
        try:
            with server as url:
                return _time(url, "x", inputs, reps), flags + extra
        except RuntimeError as e:
            if extra:
                raise
            print(f"llama-server did not start with its default repacking ({e}); "
                  "again with --no-repack")
    raise AssertionError("unreachable")


def ember_server(gguf: Path, threads: int, weights: str) -> ServerProcess:
    """``ember serve`` on the file, as its own process, for the duration of a ``with``."""
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from ember.cli import main; sys.exit(main())",
           "serve", "--model", str(gguf), "--port", str(port), "--threads", str(threads),
           "--weights", weights, "--no-ui", "--speculation", "off"]
    return ServerProcess(cmd, port, {**os.environ, "OMP_NUM_THREADS": str(threads)},
                         wait_seconds=300)


def main(gguf: Path, batches: list[int], tokens: int, threads: int, reps: int,
         weights: str, llama_server: str | None, out: Path) -> dict[str, Any]:
    from ember.models.gguf import GGUFFile

    with GGUFFile(gguf) as f:
        arch = f.architecture
        vocab = int(f.get(f"{arch}.vocab_size") or len(f.get("tokenizer.ggml.tokens")))
        pooling = f.get(f"{arch}.pooling_type")
    inputs = {n: _inputs(vocab, n, tokens, seed=n) for n in batches}
    print(f"{gguf.name}: batches of {batches} inputs x {tokens} tokens, {threads} threads, "
          f"{reps} reps (median)")
    result: dict[str, Any] = {"model": str(gguf), "tokens": tokens, "threads": threads,
                              "reps": reps, "weights": weights}
    with ember_server(gguf, threads, weights) as url:
        served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        result["ember"] = _time(url, served, inputs, reps)
    if llama_server:
        result["llama.cpp"], result["llama.cpp flags"] = _llama_cpp(
            llama_server, gguf, threads, pooling, inputs, tokens, reps)
    print(f"{'batch':>6} {'ember emb/s':>12} {'llama.cpp emb/s':>16} {'ratio':>7}")
    for n in batches:
        ours = result["ember"][n]
        theirs = result.get("llama.cpp", {}).get(n)
        ratio = f"{ours / theirs:6.2f}x" if theirs else "      -"
        print(f"{n:>6} {ours:>12.2f} {theirs or float('nan'):>16.2f} {ratio:>7}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result
