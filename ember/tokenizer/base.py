"""What every tokenizer backend shares: GGUF token types, and what a backend reads of the
vocabulary it serves (:class:`Vocabulary`) and gives it (:class:`Backend`)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import numpy as np

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class Vocabulary(Protocol):
    """What a backend reads of the :class:`~ember.tokenizer.vocab.Tokenizer` it serves."""

    model: str  # tokenizer.ggml.model
    unk_id: int | None
    tokens: list[str]  # by id
    types: np.ndarray  # GGUF token type by id
    token_to_id: dict[str, int]  # later duplicates win, as in llama.cpp


class Backend(Protocol):
    """A tokenizer model (BPE, SentencePiece, WordPiece): plain text to ids, and the
    bytes each id stands for."""

    default_ids: ClassVar[dict[str, int]]  # llama.cpp's special ids where the GGUF has none
    add_bos: bool  # llama.cpp's default when the GGUF lacks add_bos_token
    force_bos: bool  # add BOS even where the GGUF says not to
    missing_bytes: frozenset[int]  # bytes no token can express

    def __init__(self, owner: Vocabulary, metadata: dict[str, Any]) -> None: ...

    def encode(self, text: str, *, after_special: bool) -> list[int]: ...

    def find_unencodable(self, text: str) -> list[tuple[int, str]]: ...

    def token_bytes_table(self) -> list[bytes]: ...
