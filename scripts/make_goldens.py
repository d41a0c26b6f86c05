"""Regenerate the llama.cpp golden files in tests/golden/ (SmolLM2 and Gemma 3).

These files pin what llama.cpp (the reference implementation) does with the same
GGUF that ember loads, so ember's test suite can compare against it without
llama.cpp installed:

For each model profile (``--profile smollm2`` or ``gemma3``; files named after it):

* ``tests/golden/smollm2_tokens.json``: token ids for a corpus of awkward texts,
  once with control-token strings left as plain text (``special=False``) and once
  with them parsed (``special=True``), plus the vocabulary's BOS/EOS/EOT/EOG ids and
  whether the model asks for a BOS token.
* ``tests/golden/smollm2_greedy.json``: prompt ids and a 32-token greedy (argmax)
  continuation for a few prompts, with the top-1 logit and the top-1 minus top-2
  margin at every step, so near-ties are visible to the tests.

Getting llama.cpp. This script needs llama-cpp-python and must run in an
environment that has it; it deliberately does not import ember (ember's venv
does not carry llama.cpp, and llama.cpp's venv need not carry ember)::

    python -m venv /tmp/llamavenv
    /tmp/llamavenv/bin/pip install 'ember[llamacpp]'        # from the repo root, or:
    /tmp/llamavenv/bin/pip install llama-cpp-python==0.3.36  # builds llama.cpp from source

The goldens in the repository were made with llama-cpp-python 0.3.36 built from
source on CPU, 2 threads (both are recorded in the files).

Regenerating::

    /tmp/llamavenv/bin/python scripts/make_goldens.py [MODEL.gguf] [--profile smollm2]
        [--out tests/golden]

MODEL.gguf defaults to the file ember pulls for the profile's alias, e.g.
``~/.cache/ember/models/SmolLM2-135M-Instruct.Q4_1.gguf``. On a CPU that reports AMX
but whose VM does not grant it, pass ``--no-extra-bufts`` (llama.cpp's AMX buffer
type segfaults there; the goldens record the setting).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as lib
import numpy as np

MODELS_DIR = Path.home() / ".cache/ember/models"
N_THREADS = 2
N_CTX = 512
N_GREEDY = 32

# Texts chosen to exercise the pre-tokenizer and the byte-level vocabulary.
CORPUS = [
    # ASCII prose and punctuation
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Wait... what?! (Really?) Yes -- no; maybe: 'quoted' and \"double\".",
    "don't won't I'LL you're they've WE'D",
    "a+b=c; x*y/z % 2 != 0 && !flag || ~mask",
    # code, with indentation and tabs
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n\tdef bar(self):\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) {\n  sum += x[i];\n}",
    # digits
    "1234567890",
    "3.14159",
    "year 2024",
    "0x1F 1e-9 -42 +7 1,000,000",
    # whitespace runs
    "a    b",
    "\n\n\n",
    " leading",
    "trailing   ",
    "tab\tseparated\t\tvalues",
    "  \n  mixed \r\n line\tends  ",
    # accented Latin
    "français",
    "naïve café, Øre, straße, Ångström",
    # CJK
    "中文",
    "日本語のテキスト",
    "한국어",
    # emoji, including a skin-tone modifier and a ZWJ family sequence
    "👍🏽",
    "👨‍👩‍👧",
    "I ❤️ 🍕 and 🚀!",
    # a byte SmolLM2's vocabulary lacks (0x04): llama.cpp drops it
    "ctrl\x04char",
]

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The quick brown fox",
]

# Per model: the file, control-token look-alikes (only parsed with special=True) added
# to CORPUS, and a chat prompt in the model's template.
PROFILES = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "controls": [
            "<|im_end|>",
            "<|im_start|>user",
            "<|endoftext|>",
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            "not special: <|im_end |> <im_end> |im_end|",
        ],
        "chat": ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                 "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                 "<|im_end|>\n<|im_start|>assistant\n"),
    },
    "gemma3": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "controls": [
            "<end_of_turn>",
            "<start_of_turn>user",
            "<eos>",
            "<bos>text",
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
            "not special: <end_of_turn > <end-of-turn> start_of_turn",
        ],
        "chat": ("<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                 "<start_of_turn>model\n"),
    },
}


def _id(x: int) -> int | None:
    """llama.cpp uses -1 (LLAMA_TOKEN_NULL) for 'no such token'."""
    return None if x < 0 else int(x)


def vocab_info(llm: llama_cpp.Llama) -> dict:
    vocab = llm._model.vocab
    n = lib.llama_vocab_n_tokens(vocab)
    text = lambda i: lib.llama_vocab_get_text(vocab, i).decode("utf-8", "replace")  # noqa: E731
    eog = [i for i in range(n) if lib.llama_vocab_is_eog(vocab, i)]
    control = [i for i in range(n) if lib.llama_vocab_is_control(vocab, i)]
    specials = {
        "bos": lib.llama_vocab_bos(vocab),
        "eos": lib.llama_vocab_eos(vocab),
        "eot": lib.llama_vocab_eot(vocab),
        "nl": lib.llama_vocab_nl(vocab),
        "pad": lib.llama_vocab_pad(vocab),
        "sep": lib.llama_vocab_sep(vocab),
        "fim_pre": lib.llama_vocab_fim_pre(vocab),
        "fim_suf": lib.llama_vocab_fim_suf(vocab),
        "fim_mid": lib.llama_vocab_fim_mid(vocab),
        "fim_pad": lib.llama_vocab_fim_pad(vocab),
        "fim_rep": lib.llama_vocab_fim_rep(vocab),
        "fim_sep": lib.llama_vocab_fim_sep(vocab),
    }
    return {
        "n_tokens": n,
        "add_bos": bool(lib.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(lib.llama_vocab_get_add_eos(vocab)),
        "metadata_add_bos_token": llm.metadata.get("tokenizer.ggml.add_bos_token"),
        "tokenize_Hello_add_bos": llm.tokenize(b"Hello", add_bos=True, special=False),
        "tokenize_Hello_no_bos": llm.tokenize(b"Hello", add_bos=False, special=False),
        **{k: _id(v) for k, v in specials.items()},
        "eog_ids": eog,
        "eog_texts": [text(i) for i in eog],
        "control_ids": control,
    }


def tokens_golden(llm: llama_cpp.Llama, profile: dict) -> dict:
    cases = []
    for t in CORPUS + profile["controls"]:
        data = t.encode("utf-8")
        cases.append({
            "text": t,
            "ids": llm.tokenize(data, add_bos=False, special=False),
            "ids_special": llm.tokenize(data, add_bos=False, special=True),
        })
    return {"vocab": vocab_info(llm), "cases": cases}


def greedy(llm: llama_cpp.Llama, prompt_ids: list[int], eog: set[int]) -> dict:
    """Evaluate the prompt, then feed back the argmax token N_GREEDY times."""
    llm.reset()
    llm.eval(prompt_ids)
    steps = []
    for _ in range(N_GREEDY):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top2 = np.argsort(logits)[-2:][::-1]
        tok = int(top2[0])
        steps.append({
            "id": tok,
            "logit": round(float(logits[top2[0]]), 4),
            "margin": round(float(logits[top2[0]] - logits[top2[1]]), 4),
            "second": int(top2[1]),
        })
        if tok in eog:
            break
        llm.eval([tok])
    ids = [s["id"] for s in steps]
    return {
        "prompt_ids": prompt_ids,
        "ids": ids,
        "text": llm.detokenize(ids, special=True).decode("utf-8", "replace"),
        "stopped_at_eog": ids[-1] in eog,
        "steps": steps,
    }


def greedy_golden(llm: llama_cpp.Llama, add_bos: bool, chat: str) -> dict:
    eog = {i for i in range(llm.n_vocab()) if lib.llama_vocab_is_eog(llm._model.vocab, i)}
    cases = []
    for p in RAW_PROMPTS:
        # A raw completion tokenizes like llama.cpp's default completion path:
        # BOS only if the vocabulary says so (add_bos=True defers to it).
        ids = llm.tokenize(p.encode("utf-8"), add_bos=True, special=False)
        cases.append({"prompt": p, "kind": "raw", **greedy(llm, ids, eog)})
    ids = llm.tokenize(chat.encode("utf-8"), add_bos=False, special=True)
    cases.append({"prompt": chat, "kind": "chat", **greedy(llm, ids, eog)})
    return {
        "n_threads": N_THREADS,
        "n_ctx": N_CTX,
        "max_tokens": N_GREEDY,
        "raw_prompt_add_bos": add_bos,
        "note": "argmax of llama.cpp logits at each step; margin = top1 - top2 logit",
        "cases": cases,
    }


def _dump(data: dict) -> str:
    """indent=1 JSON, but lists of numbers and the per-step records on one line each."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    flat = lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]")  # noqa: E731
    text = re.sub(r"\[[\s\d.,-]*\]", flat, text)
    text = re.sub(r"\{[^{}\[\]]*\}", lambda m: flat(m).replace("{ ", "{").replace(" }", "}"),
                  text)
    return text + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="GGUF path (default: the profile's pulled file)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="smollm2")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="disable llama.cpp's extra CPU buffer types (AMX, repacking)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/golden"))
    args = ap.parse_args()
    profile = PROFILES[args.profile]
    model = args.model or str(MODELS_DIR / profile["file"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.no_extra_bufts:  # Llama() takes no such argument: adjust its defaults
        defaults = lib.llama_model_default_params

        def without_extra_bufts():  # noqa: ANN202
            params = defaults()
            params.use_extra_bufts = False
            return params

        lib.llama_model_default_params = without_extra_bufts
    llm = llama_cpp.Llama(model, n_ctx=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                          logits_all=True, verbose=False)
    source = {
        "generator": "scripts/make_goldens.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model_file": Path(model).name,
        "extra_bufts": not args.no_extra_bufts,
    }
    tokens = {"source": source, **tokens_golden(llm, profile)}
    add_bos = tokens["vocab"]["add_bos"]
    runs = {"source": source, **greedy_golden(llm, add_bos, profile["chat"])}
    for kind, data in (("tokens", tokens), ("greedy", runs)):
        path = out / f"{args.profile}_{kind}.json"
        path.write_text(_dump(data), encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
