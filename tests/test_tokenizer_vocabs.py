"""llama.cpp's own tokenizer tests as the oracle: every vocabulary it ships tests for.

llama.cpp keeps vocab-only GGUFs with inputs and the token ids its tokenizer gives
them (``models/ggml-vocab-*.gguf`` + ``.inp`` / ``.out``, checked by its
``test-tokenizer-0``: no BOS, no special-token parsing), fetched once with the rest
of the llama.cpp source the tests use (``tests/llamacpp_source.py``). A vocabulary
ember supports must give exactly llama.cpp's ids for every input; one it does not
support must be refused by name when it is loaded, never tokenized wrongly.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from llamacpp_source import llamacpp_source

from ember.errors import TokenizerError
from ember.models.gguf import GGUFFile
from ember.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

SEPARATOR = "\n__ggml_vocab_test__\n"

# Vocabularies ember tokenizes exactly as llama.cpp does (every input of its test).
EXACT = {"gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2", "qwen35", "mpt", "refact",
         "starcoder", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4",
         "bert-bge"}

# Inputs llama.cpp's own cases leave untested (a wrong tokenizer passes those), with the
# ids llama.cpp 0.3.36 gives them (llama-cpp-python's vocab_only Llama.tokenize, no BOS,
# no special-token parsing), checked like the cases above.
EXTRA_CASES: dict[str, list[tuple[str, list[int]]]] = {
    # Combining marks stay in the letter run (qwen2's regex splits them off).
    "qwen35": [
        ("\u0e01\u0e34\u0e19\u0e02\u0e49\u0e32\u0e27", [129454, 131661]),  # Thai
        ("\u0928\u092e\u0938\u094d\u0924\u0947", [60096, 87244, 78368, 30484, 97, 34370]),
        ("cafe\u0301 na\u00efve", [924, 1859, 53839, 94880, 586]),
    ],
    # <|tool_response> is user-defined in the GGUF, but llama.cpp makes it control (it
    # ends generation), so in plain text it is text; <|tool_call> stays user-defined.
    "gemma-4": [
        ("<|tool_response>", [236820, 236909, 13205, 236779, 6275, 236813]),
        ("<|tool_call>", [48]),
    ],
    # A decomposed accent is dropped; llama.cpp's NFD keeps a Hangul syllable's first
    # jamo; U+001C is a control character there, not whitespace; a mark, punctuation
    # and a format control new in Unicode 15 (after Python 3.11's unicodedata).
    "bert-bge": [
        ("cafe\u0301", [7668]),
        ("\u0130stanbul \ud55c\uad6d\uc5b4", [9960, 1469, 29991, 29999]),
        ("a\x1cb", [11113]),
        ("a\U00011f00b", [11113]),
        ("a\U00011b00b", [1037, 100, 1038]),
        ("a\U00013439b", [11113]),
    ],
}


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    return llamacpp_source() / "models"


def _cases(vocab_dir: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs as llama.cpp's test-tokenizer-0 reads them: inputs split at the
    separator (a trailing one ends the last), one line of ids per input."""
    raw = (vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = (vocab_dir / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    lines = lines[:len(texts)]
    assert len(lines) == len(texts), name
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


def test_every_vocabulary_llama_cpp_tests_is_exact_or_refused_by_name(vocab_dir: Path) -> None:
    names = sorted(p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.out")
                   for p in vocab_dir.glob("ggml-vocab-*.gguf.out"))
    assert len(names) >= 15, names
    exact, refused, wrong = [], [], {}
    for name in names:
        with GGUFFile(vocab_dir / f"ggml-vocab-{name}.gguf") as gguf:
            try:
                tok = Tokenizer.from_gguf(gguf)
            except TokenizerError as e:
                pre = gguf.metadata.get("tokenizer.ggml.pre")
                model = gguf.metadata.get("tokenizer.ggml.model")
                assert repr(pre) in str(e) or repr(model) in str(e), (name, str(e))
                refused.append(name)
                continue
        cases = _cases(vocab_dir, name) + EXTRA_CASES.get(name, [])
        bad = [text for text, want in cases
               if tok.encode(text, parse_special=False, add_bos=False) != want]
        if bad:
            wrong[name] = bad[:3]
        else:
            exact.append(name)
    assert not wrong, wrong  # a vocabulary ember loads must be exact
    assert EXACT <= set(exact), (sorted(exact), sorted(refused))


# ---------------------------------------------------------------- code, URLs, markup
# llama.cpp's vocab tests are mostly prose; code, URLs and markup exercise punctuation
# runs and mixed scripts that prose does not (deepseek-llm once split "):", "://" and
# "|>" that llama.cpp keeps whole). The oracle: llama.cpp's ids for one corpus under
# every exact vocabulary, written by tests/llamacpp_tokenize.py (llama-cpp-python
# 0.3.36) into tests/golden/code_corpus/, refreshed below when EMBER_LLAMA_PYTHON is set.
CORPUS = Path(__file__).parent / "golden" / "code_corpus"


@pytest.mark.parametrize("name", sorted(EXACT))
def test_code_urls_and_markup_tokenize_as_llama_cpp_does(vocab_dir: Path, name: str) -> None:
    cases = json.loads((CORPUS / f"{name}.json").read_text("utf-8"))["cases"]
    assert [c["text"] for c in cases] == json.loads((CORPUS / "texts.json").read_text("utf-8"))
    with GGUFFile(vocab_dir / f"ggml-vocab-{name}.gguf") as gguf:
        tok = Tokenizer.from_gguf(gguf)
    wrong = [c["text"] for c in cases
             if tok.encode(c["text"], parse_special=False, add_bos=False) != c["ids"]]
    assert not wrong, wrong[:3]


@pytest.mark.skipif(not os.environ.get("EMBER_LLAMA_PYTHON"),
                    reason="set EMBER_LLAMA_PYTHON to an interpreter with llama-cpp-python")
@pytest.mark.parametrize("name", sorted(EXACT))
def test_code_corpus_golden_is_what_llama_cpp_says_now(vocab_dir: Path, tmp_path: Path,
                                                      name: str) -> None:
    out = tmp_path / "out.json"
    subprocess.run([os.environ["EMBER_LLAMA_PYTHON"],
                    str(Path(__file__).parent / "llamacpp_tokenize.py"),
                    str(vocab_dir / f"ggml-vocab-{name}.gguf"), str(CORPUS / "texts.json"),
                    str(out)], check=True)
    if os.environ.get("EMBER_WRITE_GOLDEN"):
        (CORPUS / f"{name}.json").write_bytes(out.read_bytes())
    fresh = json.loads(out.read_text("utf-8"))["cases"]
    assert fresh == json.loads((CORPUS / f"{name}.json").read_text("utf-8"))["cases"]


# ---------------------------------------------------------------- more pre-tokenizers
# Pre-tokenizers llama.cpp has no vocab test for: tekken (Mistral Nemo, Small 3,
# Ministral 3) and gpt-4o (o200k: gpt-oss, Llama 4). The oracle: llama.cpp's ids for
# Llama 3's byte-level vocabulary (llama.cpp's ggml-vocab-llama-bpe.gguf, whose merges
# join digits and contractions, so splitting differences show) under each
# (tests/golden/<pre>_tokens.json, made by
# tests/llamacpp_tokenize.py from llama-bpe's test inputs and the texts below;
# regenerate with EMBER_LLAMA_PYTHON set and EMBER_WRITE_GOLDEN=1).
EXTRA_TEXTS = [
    "HelloWorld camelCase XMLHttpRequest getHTTPResponseCode iPhone",
    "ÉCOLE École straße ÀLaCarte ΑθήναΚαι ПриветМир",
    "abc123def 4.5e10 x2y2 1234567 12345",
    "path/to/file\n//comment\r\n/",
    "  spaced\t\ttabs \n\n\n  end  ",
    "don't WON'T I'm l'École they'RE We'Ve",
    "naïve café 日本語のテキスト 한국어 👍🏽",
]
# llama.cpp's add_bos default for a file without tokenizer.ggml.add_bos_token
PRE_TOKENIZERS = {"tekken": True, "gpt-4o": False}
pre_tokenizers = pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))


def _golden(pre: str) -> Path:
    return Path(__file__).parent / "golden" / f"{pre}_tokens.json"


@pytest.fixture(scope="module")
def llama3_vocab(tmp_path_factory: pytest.TempPathFactory, vocab_dir: Path):
    """Llama 3's vocabulary as a vocab-only GGUF of a given pre-tokenizer (without
    add_bos_token: llama.cpp's default for that pre-tokenizer applies)."""
    from hf_gguf import rewrite_gguf

    root = tmp_path_factory.mktemp("vocabs")

    def make(pre: str) -> Path:
        return rewrite_gguf(vocab_dir / "ggml-vocab-llama-bpe.gguf", root / f"{pre}.gguf",
                            drop_keys=("tokenizer.ggml.add_bos_token",),
                            add_keys={"tokenizer.ggml.pre": pre})
    return make


@pre_tokenizers
def test_pre_tokenizer_is_llama_cpps(llama3_vocab, pre: str) -> None:
    cases = json.loads(_golden(pre).read_text(encoding="utf-8"))["cases"]
    tokenizers = {}
    for name in PRE_TOKENIZERS:  # the same vocabulary under each pre-tokenizer
        with GGUFFile(llama3_vocab(name)) as g:
            tokenizers[name] = Tokenizer.from_gguf(g)
    tok = tokenizers[pre]
    wrong = [c["text"] for c in cases if tok.encode(c["text"], add_bos=False) != c["ids"]]
    assert not wrong, wrong[:3]
    assert tok.add_bos == PRE_TOKENIZERS[pre]
    for other, tokenizer in tokenizers.items():  # the golden tells the two apart
        if other != pre:
            assert sum(tokenizer.encode(c["text"], add_bos=False) != c["ids"]
                       for c in cases) >= 3, other


@pytest.mark.skipif(not os.environ.get("EMBER_LLAMA_PYTHON"),
                    reason="set EMBER_LLAMA_PYTHON to an interpreter with llama-cpp-python")
@pre_tokenizers
def test_pre_tokenizer_golden_is_what_llama_cpp_says_now(llama3_vocab, vocab_dir: Path,
                                                         tmp_path: Path, pre: str) -> None:
    texts = tmp_path / "texts.json"
    inputs = [t for t, _ in _cases(vocab_dir, "llama-bpe")] + EXTRA_TEXTS + json.loads(
        (CORPUS / "texts.json").read_text("utf-8"))
    texts.write_text(json.dumps(inputs, ensure_ascii=False), "utf-8")
    out = tmp_path / "out.json"
    subprocess.run([os.environ["EMBER_LLAMA_PYTHON"],
                    str(Path(__file__).parent / "llamacpp_tokenize.py"), str(llama3_vocab(pre)),
                    str(texts), str(out)], check=True)
    if os.environ.get("EMBER_WRITE_GOLDEN"):
        _golden(pre).write_bytes(out.read_bytes())
    fresh = json.loads(out.read_text("utf-8"))["cases"]
    assert fresh == json.loads(_golden(pre).read_text("utf-8"))["cases"]
