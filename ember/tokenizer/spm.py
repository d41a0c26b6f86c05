"""SentencePiece-style merging by token score with ``<0xXX>`` byte fallback (Gemma, Llama 2):
the GGUF carries scores, not merges, so the merging is written here."""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heappop, heappush
from typing import Any

import numpy as np

from ember.tokenizer.base import BYTE, NORMAL, UNUSED, Vocabulary


class SpmBackend:
    """llama.cpp's SPM algorithm: merge the adjacent pair whose result has the best
    score, repeatedly; pieces that are not tokens fall back to ``<0xXX>`` tokens."""

    # Only what the GGUF names: llama.cpp's fallbacks (BOS 1, EOS 2, UNK 0) are not applied.
    default_ids: dict[str, int] = {}

    def __init__(self, owner: Vocabulary, metadata: dict[str, Any]) -> None:
        self.owner = owner
        self.add_bos = True
        self.force_bos = False
        self.add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        scores = metadata.get("tokenizer.ggml.scores")
        n = len(owner.tokens)
        self._scores: list[float] = (
            np.asarray(scores, dtype=np.float64).tolist() if scores is not None else [0.0] * n
        )
        vocab = owner.token_to_id
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = vocab.get(f"<0x{b:02X}>")
            if tid is None:  # llama.cpp falls back to the byte as a one-char string
                tid = vocab.get(chr(b)) if b < 0x80 else None
            self._byte_ids.append(tid)
        self.missing_bytes = frozenset(b for b, t in enumerate(self._byte_ids) if t is None)

    def encode(self, text: str, *, after_special: bool) -> list[int]:
        if self.add_space_prefix and after_special:
            text = " " + text
        return self._merge(text.replace(" ", "\u2581"))

    def _merge(self, text: str) -> list[int]:
        vocab, scores = self.owner.token_to_id, self._scores
        n = len(text)
        if n == 0:
            return []
        # Symbol i starts at text[i]; ``size[i]`` chars long (0 = merged away).
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = [*range(1, n), -1]
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            length = size[left] + size[right]
            tid = vocab.get(text[left : left + length])
            if tid is not None:
                # Best score first; on ties the leftmost pair (llama.cpp's order).
                heappush(heap, (-scores[tid], left, right, length))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, length = heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # stale: one side changed since this pair was queued
            size[left] = length
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        return self._emit(text, size, nxt)

    def _emit(self, text: str, size: list[int], nxt: list[int]) -> list[int]:
        vocab, out = self.owner.token_to_id, []
        i = 0
        while i >= 0:
            piece = text[i : i + size[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for b in piece.replace("\u2581", " ").encode():
                    byte_id = self._byte_ids[b]
                    if byte_id is not None:  # missing ones were reported up front
                        out.append(byte_id)
            i = nxt[i]
        return out

    def find_unencodable(self, text: str) -> list[tuple[int, str]]:
        if not self.missing_bytes:
            return []
        vocab, missing = self.owner.token_to_id, self.missing_bytes
        # Conservative: a character that is not itself a token may need byte fallback.
        return [
            (i, c)
            for i, c in enumerate(text)
            if c not in vocab and any(b in missing for b in c.encode())
        ]

    def token_bytes_table(self) -> list[bytes]:
        return sentencepiece_token_bytes(self.owner.tokens, self.owner.types.tolist())


def sentencepiece_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """Bytes per id for ``▁``-escaped vocabularies (SPM, gemma4 BPE, WPM), as llama.cpp's
    ``token_to_piece``: normal tokens with ``▁`` → space, ``<0xXX>`` byte tokens → that
    byte, unused tokens → nothing, control and user-defined tokens → their text."""
    table: list[bytes] = []
    for text, ttype in zip(tokens, types, strict=True):
        if ttype == NORMAL:
            table.append(text.replace("\u2581", " ").encode())
        elif ttype == BYTE and len(text) == 6 and text.startswith("<0x"):
            table.append(bytes([int(text[3:5], 16)]))
        elif ttype == UNUSED:
            table.append(b"")
        else:
            table.append(text.encode())
    return table
