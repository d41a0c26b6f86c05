"""Tokenizer built from GGUF metadata: SmolLM2 (byte-level BPE) and, if present, Gemma 3."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ember.errors import TokenizerError
from ember.models.gguf import GGUFFile
from ember.tokenizer import CONTROL, UNKNOWN, USER_DEFINED, Tokenizer

# The bytes SmolLM2-135M's byte-level vocabulary has no token for.
SMOLLM2_MISSING_BYTES = {
    0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2,
    *range(0xF5, 0x100),
}  # fmt: skip

CORPUS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] + c[i]; }",
    "12345678",
    "pi = 3.14159, e=2.71828; 1,000,000",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs\n\nnewlines\r\n\r\nCRLF",
    "          ten spaces",
    "Café, naïve, résumé, Ærøskøbing, Straße",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "emoji 🎉🚀👍🏽 and 👨‍👩‍👧‍👦 family",
    "<|im_end|>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "< |im_end| > <|im_end <im_end|> <|IM_END|> <<|im_end|>>",
    "<repo_name> <file_sep> <|endoftext|>",
    "I'm sure they'll say it's 'quoted' and we've 'd done it",
    "mixed123abc456 x1 y22 z333",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
]


@pytest.fixture(scope="module")
def tok(smollm2_file: GGUFFile) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_file)


@pytest.fixture(scope="module")
def gemma(gemma3_file: GGUFFile) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_file)


# --------------------------------------------------------------- SmolLM2 metadata
def test_smollm2_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    assert tok.id_to_piece(1) == "<|im_start|>"
    assert tok.id_to_piece(2) == "<|im_end|>"
    # eos <|im_end|>, <|endoftext|> (llama.cpp's EOG texts) and the FIM marker
    # <reponame>, as llama.cpp has it; not BOS.
    assert tok.eog_ids == {0, 2, 4}
    assert tok.add_bos is False


GOLDEN = Path(__file__).parent / "golden" / "smollm2_tokens.json"


@pytest.fixture(scope="module")
def golden() -> dict:
    if not GOLDEN.is_file():
        pytest.skip(f"{GOLDEN} not present")
    return json.loads(GOLDEN.read_text())


def test_matches_llama_cpp_vocab(tok: Tokenizer, golden: dict) -> None:
    v = golden["vocab"]
    assert tok.vocab_size == v["n_tokens"]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (v["bos"], v["eos"], v["add_bos"])
    assert tok.eog_ids == set(v["eog_ids"])
    assert {i for i in range(tok.vocab_size) if tok.is_control(i)} == set(v["control_ids"])


def test_matches_llama_cpp_ids(tok: Tokenizer, golden: dict) -> None:
    for case in golden["cases"]:
        text = case["text"]
        assert tok.encode(text) == case["ids"], text
        assert tok.encode(text, parse_special=True) == case["ids_special"], text


def test_missing_byte_tokens_are_known(tok: Tokenizer) -> None:
    assert set(tok.unencodable_bytes) == SMOLLM2_MISSING_BYTES


# ----------------------------------------------------------------- round trips
@pytest.mark.parametrize("text", CORPUS)
def test_round_trip_corpus(tok: Tokenizer, text: str) -> None:
    assert tok.find_unencodable(text) == []
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(text=st.text(max_size=60))
def test_round_trip_property(tok: Tokenizer, text: str) -> None:
    assume(not tok.find_unencodable(text))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Plain text never yields control tokens, whatever it contains.
    assert not any(tok.is_control(i) for i in ids)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.sampled_from(["<|im_end|>", "<|im_start|>", "<|", "|>", "a", " ", "\n"])))
def test_special_lookalikes_round_trip(tok: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert 1 not in ids and 2 not in ids
    assert tok.decode(tok.encode(text, parse_special=True)) == text


def test_known_ids(tok: Tokenizer) -> None:
    # Regression pins (checked against the HF SmolLM2 tokenizer's behaviour).
    assert tok.encode("Hello world") == [19556, 905]


# ------------------------------------------------------------- pre-tokenization
def test_digits_are_isolated(tok: Tokenizer) -> None:
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")
    assert len(tok.encode("x 2024")) == 6  # "x", " ", and four digits


# -------------------------------------------------------------- special tokens
def test_literal_control_text_is_plain(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_end|>")
    assert 2 not in ids and len(ids) > 1
    assert tok.decode(ids) == "<|im_end|>"


def test_parse_special_yields_control_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_end|>", parse_special=True) == [2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", parse_special=True)
    assert ids[0] == 1 and ids.count(2) == 1
    assert ids == [1, *tok.encode("user\nhi"), 2, *tok.encode("\n")]


def test_add_bos(tok: Tokenizer) -> None:
    assert tok.encode("hi", add_bos=True) == [1, *tok.encode("hi")]
    assert tok.encode("", add_bos=True) == [1]


def test_token_bytes_and_pieces(tok: Tokenizer) -> None:
    the = tok.encode(" the")
    assert len(the) == 1
    assert tok.id_to_piece(the[0]) == "Ġthe"
    assert tok.token_bytes(the[0]) == b" the"
    assert tok.token_bytes(2) == b"<|im_end|>"
    assert tok.token_type(2) == CONTROL


def test_decode_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", parse_special=True)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "user\nhi"


def test_bad_ids_raise(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="49152"):
        tok.decode([49152])
    with pytest.raises(TokenizerError):
        tok.token_bytes(-1)


# ----------------------------------------------------------- unencodable bytes
def test_unencodable_control_char_is_dropped_with_warning(
    tok: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    assert tok.find_unencodable("a\x04b") == [(1, "\x04")]
    with caplog.at_level(logging.WARNING, logger="ember.tokenizer"):
        ids = tok.encode("a\x04b")
    # llama.cpp drops the byte too, after pre-tokenization: "a" and "b" stay apart.
    assert ids == tok.encode("a") + tok.encode("b")
    assert tok.decode(ids) == "ab"
    assert "U+0004" in caplog.text


def test_unencodable_strict_raises(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"U\+0014"):
        tok.encode("x\x14y", strict=True)


def test_unencodable_lead_byte(tok: Tokenizer) -> None:
    # U+40000 is F1 80 80 80: the lead byte has no token, the continuations do.
    text = "\U00040000z"
    assert tok.find_unencodable(text) == [(0, "\U00040000")]
    ids = tok.encode(text)
    assert tok.decode_bytes(ids) == b"\x80\x80\x80z"
    assert tok.decode(ids) == "\ufffd\ufffd\ufffdz"


def test_every_missing_ascii_byte_is_reported(tok: Tokenizer) -> None:
    text = "".join(chr(b) for b in range(0x80))
    found = {ord(c) for _, c in tok.find_unencodable(text)}
    assert found == {b for b in SMOLLM2_MISSING_BYTES if b < 0x80}
    assert tok.decode(tok.encode(text)) == "".join(c for c in text if ord(c) not in found)


def test_lone_surrogate_becomes_replacement(
    tok: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ember.tokenizer"):
        ids = tok.encode("a\ud800b")
    assert tok.decode(ids) == "a\ufffdb"
    assert "surrogate" in caplog.text
    with pytest.raises(TokenizerError):
        tok.encode("a\ud800b", strict=True)


# --------------------------------------------------------- unsupported inputs
def _tiny_bpe(**extra: object) -> dict[str, object]:
    """A byte-level vocabulary of single bytes plus a few tokens and merges."""
    from ember.tokenizer.bpe import BYTE_TO_CHAR as _BYTE_TO_CHAR

    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + ["ab", "<ctl>", "<ud>"]
    types = [1] * 256 + [1, CONTROL, USER_DEFINED]
    meta: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["a b"],
    }
    meta.update(extra)
    return meta


def test_unsupported_model_is_named() -> None:
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer(_tiny_bpe(**{"tokenizer.ggml.model": "t5"}))


def test_unsupported_pre_is_named() -> None:
    with pytest.raises(TokenizerError, match="'klingon'"):
        Tokenizer(_tiny_bpe(**{"tokenizer.ggml.pre": "klingon"}))


def test_user_defined_tokens_always_split_control_only_on_request() -> None:
    t = Tokenizer(_tiny_bpe())
    ctl, ud = 257, 258
    assert t.encode("ab<ud>ab") == [256, ud, 256]  # user-defined: always (as llama.cpp)
    assert ctl not in t.encode("<ctl>")
    assert t.encode("<ctl>", parse_special=True) == [ctl]
    assert t.token_type(ud) == USER_DEFINED
    assert t.eog_ids == set()  # no EOS named, no EOG-looking token


def test_eog_looking_token_is_forced_control() -> None:
    meta = _tiny_bpe()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<|im_end|>"]  # type: ignore[list-item]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]  # type: ignore[list-item]
    t = Tokenizer(meta)
    assert t.eog_ids == {259}
    assert t.token_type(259) == CONTROL
    assert 259 not in t.encode("<|im_end|>")


@pytest.mark.parametrize("ends", [("<|return|>", "<|call|>"), ("<|calls|>", "<|flush|>")])
def test_end_closes_a_message_not_the_reply_beside_harmonys_end_markers(ends) -> None:
    """o200k_harmony (gpt-oss) and solar-open: llama.cpp takes "<|end|>" out of the end
    markers (the reply goes on to the final channel) and makes it user-defined, so it
    is rendered as text; alone, "<|end|>" ends generation (Phi 3)."""
    extra = ["<|end|>", *ends]
    meta = _tiny_bpe()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *extra]  # type: ignore[list-item]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 3, 3, 3]  # type: ignore[list-item]
    t = Tokenizer(meta)
    assert t.eog_ids == {260, 261}
    assert t.token_type(259) == USER_DEFINED
    assert t.encode("<|end|>") == [259] and t.decode([259]) == "<|end|>"
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"][:-2], "x1", "x2"]  # type: ignore[index]
    assert Tokenizer(meta).eog_ids == {259}


# ------------------------------------------------------------------- Gemma 3
def test_gemma_metadata(gemma: Tokenizer) -> None:
    assert gemma.model == "llama"
    assert (gemma.bos_id, gemma.eos_id) == (2, 1)
    assert gemma.eog_ids == {1, 106, 212}  # <eos>, <end_of_turn>, </s> (as llama.cpp)
    assert gemma.add_bos is True
    assert gemma.unencodable_bytes == frozenset()


@pytest.mark.parametrize("text", CORPUS)
def test_gemma_round_trip(gemma: Tokenizer, text: str) -> None:
    assert gemma.decode(gemma.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_gemma_round_trip_property(gemma: Tokenizer, text: str) -> None:
    ids = gemma.encode(text)
    # SentencePiece writes a space as U+2581 and decodes every U+2581 as a space, so
    # that character comes back as a space (hypothesis found "\u2581"; llama.cpp agrees)
    assert gemma.decode(ids) == text.replace("\u2581", " ")
    assert not any(gemma.token_type(i) in (CONTROL, UNKNOWN) for i in ids)


def test_gemma_reads_the_space_marker_as_llama_cpp_does(gemma: Tokenizer) -> None:
    # ids and texts from llama-cpp-python 0.3.36 (llama.cpp 0c1e570) on the same GGUF
    assert gemma.encode("\u2581") == [236743] and gemma.decode([236743]) == " "
    assert gemma.encode(" \u2581 ") == [236743] * 3
    assert gemma.encode("a\u2581b") == [236746, 518] and gemma.decode([236746, 518]) == "a b"


def test_gemma_specials(gemma: Tokenizer) -> None:
    turn = "<start_of_turn>user\nhi<end_of_turn>\n"
    ids = gemma.encode(turn, parse_special=True)
    assert ids[0] == 105 and 106 in ids
    assert 105 not in gemma.encode(turn) and 106 not in gemma.encode(turn)
    # "\n\n" is a user-defined token: split out even from plain text.
    assert gemma.encode("a\n\nb")[1] == 108
    assert gemma.encode("hi", add_bos=True)[0] == 2


def test_gemma_byte_fallback(gemma: Tokenizer) -> None:
    text = "\x04\U00040000"  # surely not in the vocabulary as pieces
    ids = gemma.encode(text)
    assert all(gemma.token_type(i) == 6 for i in ids)  # BYTE tokens
    assert gemma.decode(ids) == text


def test_a_bpe_vocabulary_without_merges_is_refused_naming_the_key() -> None:
    metadata = _tiny_bpe()
    del metadata["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer(metadata)
