"""The tokenizer of a GGUF vocabulary: special tokens, end-of-generation ids, the backend
its ``tokenizer.ggml.model`` names, encoding and decoding (see :mod:`ember.tokenizer`)."""

from __future__ import annotations

import codecs
import functools
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ember.errors import TokenizerError
from ember.tokenizer.base import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Backend
from ember.tokenizer.bpe import BpeBackend
from ember.tokenizer.spm import SpmBackend
from ember.tokenizer.wpm import WpmBackend

log = logging.getLogger("ember.tokenizer")

# Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp, the
# special_eog_ids scan). Tokens found by text are also forced to CONTROL. "</s>"
# included: llama.cpp (0.3.36's) ends on it and makes it control even where it is
# Gemma's user-defined HTML tag (tests/golden/gemma3_tokens.json), except beside
# _OWN_EOS_MARKERS (see _read_special_ids).
EOG_TEXTS = frozenset(
    {
        "</s>",
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",  # o200k_harmony (gpt-oss)
        "<|call|>",
        "<|flush|>",  # solar-open
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",  # Gemma 4 (its EOS anyway; Gemma 3 names the same token)
        "<turn|>",  # Gemma 4
        "<|tool_response>",  # Gemma 4: user-defined there, so this makes it control
        "[EOT]",  # Kimi K2
        "[EOS]",
        "<｜end▁of▁sentence｜>",  # DeepSeek-OCR
        "[e~[",  # MiniMax M2
    }
)

# End markers of vocabularies whose "</s>" is ordinary text (llama.cpp: Gemma 4, PLaMo 2).
_OWN_EOS_MARKERS = frozenset({"<|tool_response>", "<|plamo:eos|>"})

# Fill-in-the-middle markers llama.cpp also stops on (pad, repo and file-separator
# markers), found by these texts when the GGUF does not give their ids.
FIM_EOG_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


class Tokenizer:
    """A GGUF vocabulary: ``encode`` text to ids and ``decode`` ids to text.

    Build with ``Tokenizer.from_gguf``. Attributes: ``vocab_size``, ``bos_id``,
    ``eos_id``, ``unk_id`` (``None`` when the GGUF names none), ``eog_ids`` (ids that
    end generation), ``add_bos`` (the GGUF's add_bos_token, or llama.cpp's default
    for the tokenizer kind), ``unencodable_bytes`` (bytes no token can express).
    """

    def __init__(self, metadata: dict[str, Any]) -> None:
        """Build from GGUF metadata (the ``tokenizer.*`` keys); prefer ``from_gguf``."""
        self.model = str(metadata.get("tokenizer.ggml.model", ""))
        backend_cls = BACKENDS.get(self.model)
        if backend_cls is None:
            raise TokenizerError(
                f"unsupported tokenizer model {self.model!r} (ember supports "
                f"{', '.join(repr(m) for m in BACKENDS)})"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF has no tokenizer.ggml.tokens")
        self.tokens: list[str] = list(tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            types = np.full(len(tokens), NORMAL, dtype=np.int32)
        self.types = np.asarray(types, dtype=np.int32).copy()
        if len(self.types) != len(self.tokens):
            raise TokenizerError(
                f"token_type has {len(self.types)} entries for {len(self.tokens)} tokens"
            )
        # Later duplicates win, as in llama.cpp's token_to_id map.
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}
        self._read_special_ids(metadata, backend_cls.default_ids)
        self._backend: Backend = backend_cls(self, metadata)
        # whether a whole input ends with EOS (llama.cpp's add_special: embedders such as
        # Qwen3-Embedding read the last token's state there)
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        # and with SEP (BERT's [SEP]; llama.cpp's add_sep, default on for WordPiece)
        self.add_sep = bool(metadata.get("tokenizer.ggml.add_sep_token",
                                         getattr(self._backend, "add_sep", False)))
        self.add_bos = self._backend.force_bos or bool(
            metadata.get("tokenizer.ggml.add_bos_token", self._backend.add_bos)
        )
        self._token_bytes = self._backend.token_bytes_table()
        self.unencodable_bytes: frozenset[int] = self._backend.missing_bytes
        self._build_matchers()

    @classmethod
    def from_gguf(cls, gguf_file: Any) -> Tokenizer:
        """Build the tokenizer from an open ``GGUFFile`` (uses only its metadata)."""
        return cls(gguf_file.metadata)

    # ------------------------------------------------------------ construction
    def _build_matchers(self) -> None:
        types = self.types.tolist()
        self._control_ids = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN))
        user = [i for i, t in enumerate(types) if t == USER_DEFINED]
        # Plain text: user-defined tokens only. Chat prompts: control/unknown too.
        self._always = _SpecialMatcher(self.tokens, user)
        self._with_control = _SpecialMatcher(self.tokens, sorted(self._control_ids) + user)

    def _force_control(self, tid: int) -> None:
        # llama.cpp overrides the type of end-marker tokens to CONTROL so user
        # text can never produce them.
        if self.types[tid] != CONTROL:
            log.info(  # llama.cpp warns too; a known quirk of Gemma's </s>, nothing to do
                "token %d %r is not control-type; treating it as control", tid, self.tokens[tid]
            )
            self.types[tid] = CONTROL

    def _read_special_ids(self, metadata: dict[str, Any], defaults: dict[str, int]) -> None:
        """Special ids from the GGUF, else the tokenizer model's llama.cpp defaults."""
        n = len(self.tokens)

        def special(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}_token_id")
            if value is not None and not 0 <= int(value) < n:
                log.warning("ignoring out-of-range tokenizer.ggml.%s_token_id=%s", key, value)
                value = None
            if value is None:
                value = defaults.get(key)
            return int(value) if value is not None and 0 <= int(value) < n else None

        self.bos_id = special("bos")
        self.eos_id = special("eos")
        self.unk_id = special("unknown")
        self.pad_id = special("padding")
        self.sep_id = special("seperator")  # (llama.cpp's spelling of the key)
        by_text = self.token_to_id
        eog = {by_text[t] for t in EOG_TEXTS if t in by_text}
        for key, texts in FIM_EOG_TEXTS.items():
            found = special(key)
            if found is None:
                # The first listed text present wins, so the result is deterministic.
                found = next((by_text[t] for t in texts if t in by_text), None)
            if found is not None:
                eog.add(found)
        forced = set(eog)
        eog.update(i for i in (self.eos_id, special("eot"), special("eom")) if i is not None)
        # Gemma 4 (and PLaMo 2) have an ordinary "</s>": beside their own end markers,
        # llama.cpp takes it out of the end markers and makes it a normal token.
        s_id = by_text.get("</s>")
        if s_id in eog and any(self.tokens[i] in _OWN_EOS_MARKERS for i in eog):
            eog.discard(s_id)
            forced.discard(s_id)
            self.types[s_id] = NORMAL
        # o200k_harmony (gpt-oss), solar-open: "<|end|>" closes a message, not the reply,
        # where the calls' and returns' markers end it; llama.cpp then takes "<|end|>"
        # out of the end markers and makes it user-defined (rendered as text).
        texts = {self.tokens[i] for i in eog}
        end_id = by_text.get("<|end|>")
        if end_id in eog and ({"<|return|>", "<|call|>"} <= texts
                              or ({"<|call|>", "<|calls|>"} & texts and "<|flush|>" in texts)):
            eog.discard(end_id)
            forced.discard(end_id)
            self.types[end_id] = USER_DEFINED
        for tid in forced:
            self._force_control(tid)
        self.eog_ids: frozenset[int] = frozenset(eog)

    # ----------------------------------------------------------------- queries
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token plain text can produce (control tokens excluded).

        A text of N characters (so at least N UTF-8 bytes) encodes to at least
        ``ceil(N / max_token_bytes)`` tokens: the server refuses a prompt that cannot
        fit the context window by this bound, before tokenizing it.
        """
        return max(len(b) for i, b in enumerate(self._token_bytes)
                   if i not in self._control_ids) or 1

    def id_to_piece(self, token_id: int) -> str:
        """The token's vocabulary string as stored in the GGUF (e.g. ``'Ġthe'``)."""
        return self.tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for; control tokens give their text."""
        return self._token_bytes[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        """The GGUF token type (NORMAL, CONTROL, USER_DEFINED, ...)."""
        return int(self.types[self._check_id(token_id)])

    def is_control(self, token_id: int) -> bool:
        """True for control and unknown tokens (never produced from plain text)."""
        return token_id in self._control_ids

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self.tokens):
            raise TokenizerError(f"token id {token_id} outside vocabulary of {len(self.tokens)}")
        return token_id

    # ----------------------------------------------------------------- encode
    def encode(
        self,
        text: str,
        *,
        parse_special: bool = False,
        add_bos: bool = False,
        strict: bool = False,
    ) -> list[int]:
        """Token ids for ``text``.

        ``parse_special``: control-token strings in ``text`` become their ids (use it
        for rendered chat templates only, never for user text). ``add_bos``: prefix
        ``bos_id`` (``tokenizer.add_bos`` says whether the model expects it).
        ``strict``: raise ``TokenizerError`` instead of dropping (with a warning)
        characters the vocabulary cannot encode.
        """
        text = self._clean_surrogates(text, strict)
        bad = self.find_unencodable(text)
        if bad:
            msg = _describe_unencodable(bad)
            if strict:
                raise TokenizerError(f"text contains characters the vocabulary lacks: {msg}")
            log.warning("dropping bytes the vocabulary cannot encode: %s", msg)
        matcher = self._with_control if parse_special else self._always
        return self._encode_pieces(matcher.partition(text), add_bos)

    def encode_segments(
        self, segments: Iterable[tuple[str, bool]], *, add_bos: bool = False
    ) -> list[int]:
        """Encode consecutive text segments as one text; ``(text, trusted)`` pairs.

        Control-token strings become ids only inside *trusted* segments (chat-template
        text), never inside untrusted ones (message content), so a user typing
        ``<|im_end|>`` cannot end a turn. Plain text is merged across segment
        boundaries before BPE, so the ids equal a one-shot encoding of the whole text
        whenever the untrusted segments hold no control-token strings.
        """
        pieces: list[str | int] = []
        for text, trusted in segments:
            text = self._clean_surrogates(text, strict=False)
            bad = self.find_unencodable(text)
            if bad:
                log.warning("dropping bytes the vocabulary cannot encode: %s",
                            _describe_unencodable(bad))
            matcher = self._with_control if trusted else self._always
            for piece in matcher.partition(text):
                if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
                    pieces[-1] += piece
                else:
                    pieces.append(piece)
        return self._encode_pieces(pieces, add_bos)

    def _encode_pieces(self, pieces: Iterable[str | int], add_bos: bool) -> list[int]:
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos requested but the GGUF names no BOS token")
            ids.append(self.bos_id)
        prev_special = True
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
                prev_special = True
            else:
                ids.extend(self._backend.encode(piece, after_special=prev_special))
                prev_special = False
        return ids

    def find_unencodable(self, text: str) -> list[tuple[int, str]]:
        """(index, character) for each character of ``text`` that encoding would lose."""
        return self._backend.find_unencodable(text)

    @staticmethod
    def _clean_surrogates(text: str, strict: bool) -> str:
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            pass
        bad = [(i, c) for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF]
        msg = _describe_unencodable(bad)
        if strict:
            raise TokenizerError(f"text contains lone surrogates: {msg}") from None
        log.warning("replacing lone surrogates with U+FFFD: %s", msg)
        return re.sub("[\ud800-\udfff]", "\ufffd", text)

    # ----------------------------------------------------------------- decode
    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``: token bytes joined, decoded as UTF-8 (invalid → U+FFFD).

        ``skip_special`` drops control and unknown tokens (as llama.cpp's
        ``special=false``); otherwise they appear as their text.
        """
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """The raw bytes of ``ids`` (see ``decode``)."""
        table = self._token_bytes
        n = len(table)
        out = []
        for i in ids:
            if not 0 <= i < n:
                raise TokenizerError(f"token id {i} outside vocabulary of {n}")
            if skip_special and i in self._control_ids:
                continue
            out.append(table[i])
        return b"".join(out)


class _SpecialMatcher:
    """Cuts text at special-token strings the way llama.cpp's st_partition does.

    llama.cpp walks the special tokens longest first and splits every raw fragment
    at each occurrence. A trie scan first finds which specials occur at all, so
    the walk only visits those (Gemma has 6k+ specials).
    """

    def __init__(self, tokens: Sequence[str], ids: Sequence[int]) -> None:
        self.tokens = tokens
        self._trie: dict[str, Any] = {}
        for tid in ids:
            text = tokens[tid]
            if not text:
                continue
            node = self._trie
            for ch in text:
                node = node.setdefault(ch, {})
            node[""] = tid  # "" marks the end of a token; later duplicates win
        first = "".join(sorted(k for k in self._trie))
        self._starts = re.compile(f"[{re.escape(first)}]") if first else None

    def _occurring(self, text: str) -> set[int]:
        found: set[int] = set()
        n = len(text)
        for m in self._starts.finditer(text) if self._starts else ():
            node, i = self._trie, m.start()
            while i < n:
                node = node.get(text[i])
                if node is None:
                    break
                if "" in node:
                    found.add(node[""])
                i += 1
        return found

    def partition(self, text: str) -> list[str | int]:
        """``text`` as a list of plain-text pieces (str) and special token ids (int)."""
        found = self._occurring(text)
        pieces: list[str | int] = [text] if text else []
        # Longest (in UTF-8 bytes) first, as llama.cpp sorts; ties by id.
        order = sorted(found, key=lambda t: (-len(self.tokens[t].encode()), t))
        for tid in order:
            needle = self.tokens[tid]
            split: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int) or needle not in piece:
                    split.append(piece)
                    continue
                parts = piece.split(needle)
                for k, part in enumerate(parts):
                    if k:
                        split.append(tid)
                    if part:
                        split.append(part)
            pieces = split
        return pieces


def _describe_unencodable(bad: list[tuple[int, str]], limit: int = 8) -> str:
    shown = ", ".join(f"U+{ord(c):04X} at {i}" for i, c in bad[:limit])
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return f"{len(bad)} character(s): {shown}{more}"


BACKENDS: dict[str, type[Backend]] = {
    "gpt2": BpeBackend,
    "gemma4": BpeBackend,
    "llama": SpmBackend,
    "bert": WpmBackend,
}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, one token at a time.

    ``push`` returns only complete characters: bytes of a character split across
    tokens are held until the character completes. Invalid UTF-8 becomes U+FFFD as
    soon as it is known to be invalid. ``flush`` ends the stream; incomplete trailing
    bytes then become one U+FFFD. The concatenation of all ``push`` results and
    ``flush`` equals ``tokenizer.decode(ids, skip_special=skip_special)``. Work per
    token is proportional to that token's bytes.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        tok = self._tokenizer
        if self._skip_special and tok.is_control(token_id):
            return ""
        return self._decoder.decode(tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        """End the stream: return held-back bytes as text (incomplete → U+FFFD)."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
