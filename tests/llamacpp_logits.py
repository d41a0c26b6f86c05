"""llama.cpp's logits for one token sequence, run under an interpreter that has
llama-cpp-python (never ember): ``python llamacpp_logits.py MODEL OUT.npy 1,2,3 [LORA]``.

Float32 KV cache, no flash attention: llama.cpp's exact path on an f32 file. A context
of 256, which llama.cpp does not pad further: LongRoPE files switch to their long
factors above their original context (256 in the tiny one)."""

import sys

import llama_cpp
import numpy as np
from llamacpp_buffers import use_plain_buffers

path, out, ids = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
lora = sys.argv[4] if len(sys.argv) > 4 else None  # a GGUF LoRA adapter, applied at scale 1
if lora:
    use_plain_buffers()  # llama.cpp's adapters crash on the repacked weight buffers
llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=256, n_batch=256, n_threads=2,
                      type_k=0, type_v=0, flash_attn=False, verbose=False,  # 0: GGML_TYPE_F32
                      lora_path=lora)
llm.eval(ids)
np.save(out, np.array(llm.scores[:len(ids)], dtype=np.float32))
