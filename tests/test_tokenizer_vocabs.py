"""llama.cpp's own tokenizer tests as the oracle: every vocabulary it ships tests for.

llama.cpp keeps vocab-only GGUFs with inputs and the token ids its tokenizer gives
them (``models/ggml-vocab-*.gguf`` + ``.inp`` / ``.out``, checked by its
``test-tokenizer-0``: no BOS, no special-token parsing). They are taken from the
llama-cpp-python 0.3.36 sdist (``pip download``, ~75 MB, once), cached under
``$EMBER_HOME/llama-vocab``; ``EMBER_LLAMA_VOCAB_DIR`` may point at a llama.cpp
``models`` directory instead. A vocabulary ember supports must give exactly
llama.cpp's ids for every input; one it does not support must be refused by name
when it is loaded, never tokenized wrongly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from ember.errors import TokenizerError
from ember.models.gguf import GGUFFile
from ember.models.registry import ember_home
from ember.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

SDIST_VERSION = "0.3.36"
SEPARATOR = "\n__ggml_vocab_test__\n"

# Vocabularies ember tokenizes exactly as llama.cpp does (every input of its test).
EXACT = {"gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2", "mpt", "refact", "starcoder",
         "command-r", "deepseek-coder", "deepseek-llm", "falcon"}


def _download(dest: Path) -> None:
    """The vocab tests out of llama-cpp-python's sdist, fetched by pip."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={SDIST_VERSION}",
                        "-d", tmp], check=True)
        [sdist] = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/vendor/llama.cpp/models/" in member.name and name.startswith("ggml-vocab-"):
                    (dest / name).write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    given = os.environ.get("EMBER_LLAMA_VOCAB_DIR")
    if given:
        return Path(given)
    cache = ember_home() / "llama-vocab"
    if not any(cache.glob("ggml-vocab-*.gguf.out")):
        _download(cache)
    return cache


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
        bad = [text for text, want in _cases(vocab_dir, name)
               if tok.encode(text, parse_special=False, add_bos=False) != want]
        if bad:
            wrong[name] = bad[:3]
        else:
            exact.append(name)
    assert not wrong, wrong  # a vocabulary ember loads must be exact
    assert EXACT <= set(exact), (sorted(exact), sorted(refused))
