"""WordPiece (llama.cpp's WPM, BERT vocabularies): BERT's normalization, words split at
whitespace and punctuation, then greedy longest-match of pieces."""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Any

from ember.errors import TokenizerError
from ember.tokenizer.base import Vocabulary
from ember.tokenizer.spm import sentencepiece_token_bytes

# WPM word splitting, per (NFD-mapped) character: what llama.cpp's
# llm_tokenizer_wpm_session::preprocess does with it.
_WPM_SPACE, _WPM_DROP, _WPM_ALONE, _WPM_APPEND = range(4)
# llama.cpp's whitespace set (its unicode-data's Unicode White_Space list): unlike
# str.isspace(), not U+001C-U+001F (control characters, so dropped instead).
_WPM_WHITESPACE = frozenset(
    [*map(chr, range(0x09, 0x0E)), *map(chr, range(0x2000, 0x200B)),
     " ", "\x85", "\xa0", "\u1680", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000"]
)


# Marks, punctuation and format controls new in Unicode 15.0/15.1, the version of
# llama.cpp's tables; Python 3.11's unicodedata (Unicode 14) calls them unassigned,
# which would keep them inside words. (Exhaustively checked: with these, every code
# point is treated as llama.cpp 0.3.36 treats it.)
_UNICODE15_CATEGORIES = (
    (
        "Mn",
        re.compile(
            "[\u0cf3\u0ece\U00010efd-\U00010eff\U00011241\U00011f00\U00011f01\U00011f03"
            "\U00011f34-\U00011f3a\U00011f3e-\U00011f42\U00013440\U00013447-\U00013455"
            "\U0001e08f\U0001e4ec-\U0001e4ef]"
        ),
    ),
    ("Po", re.compile("[\U00011b00-\U00011b09\U00011f43-\U00011f4f]")),
    ("Cf", re.compile("[\U00013439-\U0001343f]")),
)


def _wpm_category(ch: str) -> str:
    cat = unicodedata.category(ch)
    if cat == "Cn":  # maybe assigned after this Python's Unicode database
        return next((new for new, chars in _UNICODE15_CATEGORIES if chars.match(ch)), cat)
    return cat


def _wpm_is_chinese(cp: int) -> bool:
    """llama.cpp's (and BERT's) CJK ideograph ranges, including its 0x2B920 quirk."""
    return (
        0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F
    )


@functools.lru_cache(maxsize=65536)
def _wpm_char(ch: str, lowercase: bool, strip_accents: bool) -> tuple[int, str]:
    """(what to do, text to emit) for one character of WPM input."""
    if strip_accents:
        # llama.cpp's "NFD" keeps only the first code point of the decomposition
        # (é → e, and a Hangul syllable → its leading jamo); the mark is not kept.
        ch = unicodedata.normalize("NFD", ch)[0]
    if ch in _WPM_WHITESPACE:
        return _WPM_SPACE, ""
    cat = _wpm_category(ch)
    if ch in ("\0", "\ufffd") or cat in ("Cc", "Cf", "Co", "Cs"):
        return _WPM_DROP, ""
    if strip_accents and cat[0] == "M":
        return _WPM_DROP, ""
    out = ch
    if lowercase:
        # Simple (one code point) lowercase, as llama.cpp's table: str.lower() differs
        # only for U+0130 İ, whose full lowercase is two code points.
        out = "i" if ch == "\u0130" else ch.lower()
    if cat[0] == "P" or (cat[0] == "S" and ord(ch) < 0x7F) or _wpm_is_chinese(ord(ch)):
        return _WPM_ALONE, out
    return _WPM_APPEND, out


class WpmBackend:
    """WordPiece as llama.cpp's WPM tokenizer: normalize, split into words at whitespace
    and around punctuation / CJK characters, then cover ``"▁" + word`` left to right by
    the longest tokens; a word that cannot be covered becomes the unknown token.

    The GGUF stores BERT's ``word`` as ``▁word`` and its ``##piece`` continuations as
    ``piece``, so decoding (``▁`` → space) joins continuations to the word before them.
    """

    default_ids = {"bos": 101, "unknown": 100, "padding": 0, "seperator": 102}  # llama.cpp's

    def __init__(self, owner: Vocabulary, metadata: dict[str, Any]) -> None:
        self.owner = owner
        self.add_bos = True  # BERT's [CLS]; a whole input also ends with [SEP] (add_sep)
        self.add_sep = True
        self.force_bos = False
        self.missing_bytes: frozenset[int] = frozenset()  # nothing dropped: [UNK] instead
        self.lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
        self.strip_accents = bool(
            metadata.get("tokenizer.ggml.normalizer.strip_accents", self.lowercase)
        )
        if owner.unk_id is None:
            raise TokenizerError("WPM vocabulary without an unknown token")
        self._unk = owner.unk_id
        self._max_len = max(len(t) for t in owner.tokens)

    def _words(self, text: str) -> list[str]:
        words: list[str] = []
        word: list[str] = []
        for ch in text:
            action, out = _wpm_char(ch, self.lowercase, self.strip_accents)
            if action == _WPM_APPEND:
                word.append(out)
            elif action != _WPM_DROP:  # whitespace ends the word, punctuation stands alone
                if word:
                    words.append("".join(word))
                    word = []
                if action == _WPM_ALONE:
                    words.append(out)
        if word:
            words.append("".join(word))
        return words

    def encode(self, text: str, *, after_special: bool) -> list[int]:
        vocab, ids = self.owner.token_to_id, []
        for word in self._words(text):
            piece, n, pos = "\u2581" + word, len(word) + 1, 0
            word_ids: list[int] = []
            while pos < n:
                for end in range(min(n, pos + self._max_len), pos, -1):
                    tid = vocab.get(piece[pos:end])
                    if tid is not None:
                        word_ids.append(tid)
                        pos = end
                        break
                else:  # no token starts here: the whole word is unknown
                    word_ids = [self._unk]
                    break
            ids.extend(word_ids)
        return ids

    def find_unencodable(self, text: str) -> list[tuple[int, str]]:
        return []  # nothing is dropped byte-wise: an uncoverable word becomes [UNK]

    def token_bytes_table(self) -> list[bytes]:
        return sentencepiece_token_bytes(self.owner.tokens, self.owner.types.tolist())


# tokenizer.ggml.model → implementation; "gemma4" is BPE with its own pre-tokenizer.
