"""Byte-pair encoding through the ``tokenizers`` library: byte-level (GPT-2 style) for
``gpt2`` vocabularies, SentencePiece style for ``gemma4``."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from ember.errors import TokenizerError
from ember.tokenizer.base import BYTE, NORMAL, UNUSED, Vocabulary
from ember.tokenizer.pretokenizers import PRE_TYPES
from ember.tokenizer.spm import sentencepiece_token_bytes

log = logging.getLogger("ember.tokenizer")

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
BYTE_DECODE = str.maketrans({c: chr(b) for b, c in BYTE_TO_CHAR.items()})


def utf8_class(missing: Iterable[int]) -> str:
    """A regex character class of the code points whose UTF-8 form uses a missing byte.

    Continuation bytes (0x80-0xBF) can sit in almost any non-ASCII character, so if
    one is missing the class covers all non-ASCII and callers check each hit.
    """
    parts: list[str] = []
    for b in sorted(set(missing)):
        if b < 0x80:
            parts.append(re.escape(chr(b)))
        elif b < 0xC0:
            parts.append("\x80-\U0010ffff")
        elif 0xC2 <= b <= 0xDF:
            lo = (b & 0x1F) << 6
            parts.append(f"{re.escape(chr(lo))}-{re.escape(chr(lo + 0x3F))}")
        elif 0xE0 <= b <= 0xEF:
            lo = max((b & 0x0F) << 12, 0x800)
            parts.append(f"{re.escape(chr(lo))}-{re.escape(chr(((b & 0x0F) << 12) + 0xFFF))}")
        elif 0xF0 <= b <= 0xF4:
            lo = max((b & 0x07) << 18, 0x10000)
            hi = min(((b & 0x07) << 18) + 0x3FFFF, 0x10FFFF)
            parts.append(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}")
        # 0xC0, 0xC1 and 0xF5-0xFF never occur in UTF-8.
    return f"[{''.join(parts)}]" if parts else ""


class BpeBackend:
    """BPE through ``tokenizers`` (no added tokens: plain text only).

    Byte-level (GPT-2 style) for ``gpt2`` vocabularies; SentencePiece style (raw UTF-8,
    ``▁`` for spaces, ``<0xXX>`` fallback) for pre-tokenizers with ``spm_style``.
    """

    default_ids: dict[str, int] = {}  # llama.cpp has none for BPE: all from the GGUF

    def __init__(self, owner: Vocabulary, metadata: dict[str, Any]) -> None:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        pre_name = metadata.get("tokenizer.ggml.pre")
        if owner.model == "gemma4":
            pre_name = "gemma4"  # llama.cpp ignores the GGUF's pre for this model
        elif pre_name is None:
            log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' regexes")
            pre_name = "default"
        pre = PRE_TYPES.get(str(pre_name))
        if pre is None:
            raise TokenizerError(
                f"unsupported BPE pre-tokenizer {pre_name!r} "
                f"(supported: {', '.join(sorted(PRE_TYPES))})"
            )
        merges = metadata.get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("BPE GGUF has no tokenizer.ggml.merges")
        self.owner = owner
        self.pre = pre
        self.add_bos = pre.add_bos
        self.force_bos = pre.force_bos
        vocab = owner.token_to_id
        try:
            bpe = models.BPE(
                vocab=vocab,
                merges=[pair for pair in map(_split_merge, merges) if pair is not None],
                ignore_merges=pre.ignore_merges,
                byte_fallback=pre.spm_style,
            )
        except Exception as e:  # the tokenizers library's own (a merge of unknown tokens)
            raise TokenizerError(f"the BPE vocabulary and merges do not fit: {e}") from None
        self.hf = HFTokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        if pre.spm_style:
            self.hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
            self.hf.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            )
            # (Gemma 4 has all 256. Were one missing, tokenizers would drop the whole
            # character where llama.cpp drops only that byte; either way it is reported.)
            self.missing_bytes = frozenset(b for b in range(256) if f"<0x{b:02X}>" not in vocab)
        else:
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            self.hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
            self.hf.decoder = decoders.ByteLevel()
            self.missing_bytes = frozenset(b for b, c in BYTE_TO_CHAR.items() if c not in vocab)
        cls = utf8_class(self.missing_bytes)
        self._suspect = re.compile(cls) if cls else None

    def encode(self, text: str, *, after_special: bool) -> list[int]:
        if self.pre.spm_style:
            text = text.replace(" ", "\u2581")
        return self.hf.encode(text, add_special_tokens=False).ids

    def find_unencodable(self, text: str) -> list[tuple[int, str]]:
        if self._suspect is None:
            return []
        missing, vocab = self.missing_bytes, self.owner.token_to_id
        return [
            (m.start(), m.group())
            for m in self._suspect.finditer(text)
            if any(b in missing for b in m.group().encode())
            # SentencePiece style: only a character that is no token falls back to bytes.
            and not (self.pre.spm_style and m.group().replace(" ", "\u2581") in vocab)
        ]

    def token_bytes_table(self) -> list[bytes]:
        """Bytes per id: byte-level pieces un-mapped; special tokens' raw text."""
        tokens, types = self.owner.tokens, self.owner.types.tolist()
        if self.pre.spm_style:
            return sentencepiece_token_bytes(tokens, types)
        table = [b"" if ty == UNUSED else t.encode() for t, ty in zip(tokens, types, strict=True)]
        normal = [i for i, ty in enumerate(types) if ty in (NORMAL, BYTE)]
        # Un-map all byte-level pieces in one translate/encode pass (49k tokens in
        # a few ms), then slice: each piece character stands for exactly one byte.
        joined = "".join(tokens[i] for i in normal).translate(BYTE_DECODE)
        try:
            raw = joined.encode("latin-1")
        except UnicodeEncodeError:  # a piece that is not byte-level text: go one by one
            for i in normal:
                table[i] = _unmap_piece(tokens[i])
            return table
        pos = 0
        for i in normal:
            n = len(tokens[i])
            table[i] = raw[pos : pos + n]
            pos += n
        return table


def _split_merge(merge: str) -> tuple[str, str] | None:
    """A GGUF merge line as its pair, split where llama.cpp splits it: at the first space
    after the first character (so a left part may itself be a space)."""
    pos = merge.find(" ", 1)
    return (merge[:pos], merge[pos + 1 :]) if pos >= 0 else None


def _unmap_piece(piece: str) -> bytes:
    try:
        return piece.translate(BYTE_DECODE).encode("latin-1")
    except UnicodeEncodeError:  # not byte-level text: keep it as UTF-8
        return piece.encode()
