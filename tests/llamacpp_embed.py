"""llama.cpp's pooled outputs for token sequences, run under an interpreter that has
llama-cpp-python (never ember): ``python llamacpp_embed.py MODEL OUT.npy POOLING IDS.json``.

POOLING is llama.cpp's pooling type (-1: the file's; 4: rank, whose outputs are the
classifier's). Each sequence is decoded alone, every token an output, in an f32 KV
cache without flash attention: llama.cpp's exact path on an f32 file. Embeddings are
written as llama.cpp returns them (not normalised)."""

import json
import sys

import llama_cpp
import numpy as np
from llamacpp_buffers import use_plain_buffers

path, out, pooling = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(sys.argv[4]) as f:
    inputs = json.load(f)
use_plain_buffers()  # the extra ones segfault in llama_decode on an AMX machine
llm = llama_cpp.Llama(model_path=path, embedding=True, pooling_type=pooling, n_ctx=2048,
                      n_batch=2048, n_ubatch=2048, n_threads=2, type_k=0, type_v=0,
                      flash_attn=False, verbose=False)
rank = llm.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_RANK
width = llama_cpp.llama_model_n_cls_out(llm.model) if rank else llm.n_embd()
rows = []
for ids in inputs:
    llm._batch.reset()
    llm._batch.add_sequence(ids, 0, True)
    llm._ctx.kv_cache_clear()
    llm._ctx.decode(llm._batch)
    rows.append(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)[:width])
np.save(out, np.array(rows, dtype=np.float32))
