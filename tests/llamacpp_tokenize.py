"""llama.cpp's token ids for texts, run under an interpreter that has llama-cpp-python
(never ember): ``python llamacpp_tokenize.py VOCAB.gguf TEXTS.json OUT.json``.

TEXTS.json is a list of strings; OUT.json gets ``{"source", "cases": [{"text", "ids"}]}``
as llama.cpp's test-tokenizer-0 tokenizes (no BOS, no special-token parsing)."""

import json
import sys

import llama_cpp

path, texts_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
texts = json.load(open(texts_file, encoding="utf-8"))
cases = [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)}
         for t in texts]
source = {"generator": "tests/llamacpp_tokenize.py",
          "llama_cpp_python": llama_cpp.__version__}
with open(out, "w", encoding="utf-8") as f:  # one case per line
    f.write('{"source": ' + json.dumps(source) + ',\n "cases": [\n')
    f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
    f.write("\n]}\n")
