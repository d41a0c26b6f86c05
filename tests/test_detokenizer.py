"""IncrementalDetokenizer: streamed text never splits a character and matches decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.models.gguf import GGUFFile
from ember.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_file: GGUFFile) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_file)


def _stream(tok: Tokenizer, ids: list[int], **kw: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, **kw)
    return [detok.push(i) for i in ids], detok.flush()


def _byte_token(tok: Tokenizer, b: int) -> int:
    """The id of the single-byte token for byte ``b``."""
    ids = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([b])]
    assert ids, f"no token for byte {b:#x}"
    return ids[0]


def test_emoji_split_across_tokens_is_held_back(tok: Tokenizer) -> None:
    ids = [_byte_token(tok, b) for b in "🎉".encode()]  # F0 9F 8E 89: four tokens
    pushes, tail = _stream(tok, ids)
    assert pushes == ["", "", "", "🎉"]
    assert tail == ""


@pytest.mark.parametrize("text", ["日本語 テキスト", "emoji 🎉🚀👍🏽 ok", "naïve café", "a👨‍👩‍👧b"])
def test_pushes_are_whole_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pushes, tail = _stream(tok, ids)
    assert "".join(pushes) + tail == text
    assert all("\ufffd" not in p for p in pushes)
    # Every prefix emitted so far is a prefix of the text: no partial characters.
    emitted = ""
    for p in pushes:
        emitted += p
        assert text.startswith(emitted)


def test_flush_replaces_incomplete_tail(tok: Tokenizer) -> None:
    ids = [_byte_token(tok, b) for b in "世".encode()[:2]]
    pushes, tail = _stream(tok, ids)
    assert pushes == ["", ""]
    assert tail == "\ufffd"
    assert tok.decode(ids) == "\ufffd"


def test_invalid_bytes_are_not_held_forever(tok: Tokenizer) -> None:
    # A lone continuation byte can never complete: it is replaced immediately.
    cont = _byte_token(tok, 0x80)
    a = tok.encode("a")[0]
    assert _stream(tok, [cont, a]) == (["\ufffd", "a"], "")


def test_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>", parse_special=True)
    pushes, tail = _stream(tok, ids, skip_special=True)
    assert "".join(pushes) + tail == tok.decode(ids, skip_special=True) == "assistant\nHi!"
    pushes, tail = _stream(tok, ids)
    assert "".join(pushes) + tail == tok.decode(ids)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_stream_equals_decode_for_any_ids(tok: Tokenizer, ids: list[int]) -> None:
    pushes, tail = _stream(tok, ids)
    assert "".join(pushes) + tail == tok.decode(ids)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=50))
def test_stream_equals_decode_for_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pushes, tail = _stream(tok, ids)
    assert "".join(pushes) + tail == tok.decode(ids)


def test_detokenizer_is_reusable_after_flush(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    first = _byte_token(tok, 0xE4)
    assert detok.push(first) == ""
    assert detok.flush() == "\ufffd"
    assert detok.push(tok.encode("x")[0]) == "x"


def test_cost_per_token_does_not_grow(tok: Tokenizer, monkeypatch) -> None:
    """Each push reads its own token's bytes and nothing of the history: re-decoding the
    history each step would be quadratic. Counted in tokens read, not in seconds."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 日本 🎉 " * 400)
    read = 0

    def counting(method):
        def wrapped(arg, *args, **kwargs):
            nonlocal read
            arg = arg if isinstance(arg, int) else list(arg)
            read += 1 if isinstance(arg, int) else len(arg)
            return method(arg, *args, **kwargs)
        return wrapped

    for name in ("decode", "decode_bytes", "token_bytes", "id_to_piece"):
        monkeypatch.setattr(tok, name, counting(getattr(tok, name)))
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.push(i)
    assert 0 < read <= len(ids), f"{len(ids)} pushes read {read} tokens"
