"""Tokenize and detokenize text with the vocabulary stored in a GGUF file.

llama.cpp is the reference: for the same GGUF and text, ``encode`` aims to return the
ids llama.cpp's ``llama_tokenize`` returns. Four tokenizer models are supported:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE, run by the HuggingFace
  ``tokenizers`` library. The pre-tokenizer regexes are chosen from
  ``tokenizer.ggml.pre`` the way llama.cpp chooses them (e.g. ``smollm`` isolates
  every digit before applying the GPT-2 regex).
* ``tokenizer.ggml.model == "gemma4"``: the same BPE machinery in SentencePiece
  style, as llama.cpp's ``gemma4`` pre-type: spaces become ``▁``, merges run on raw
  UTF-8 characters of whole lines, and a piece that is no token falls back to
  ``<0xXX>`` byte tokens.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style merging by token score
  with ``<0xXX>`` byte fallback (Gemma, Llama 2), implemented here in Python
  because the GGUF carries scores, not merges.
* ``tokenizer.ggml.model == "bert"``: WordPiece (llama.cpp's WPM): BERT's
  normalization (lowercase, accents stripped), words split at whitespace and
  punctuation, then greedy longest-match of ``▁word`` / continuation pieces.

Any other tokenizer model, or a ``tokenizer.ggml.pre`` not listed in
``_pre_types``, raises ``TokenizerError`` naming it.

Special tokens. Before the model's own step the text is cut at special-token strings,
like llama.cpp's ``tokenizer_st_partition``: user-defined tokens (token type 4) are
always cut out, control and unknown tokens (types 3 and 2) only when
``parse_special=True``. So a user typing ``<|im_end|>`` gets ordinary text pieces,
while a rendered chat template encoded with ``parse_special=True`` gets the single
control id. Per-token lstrip/rstrip attributes are not in GGUF and are not applied.

Unencodable bytes. A byte-level BPE vocabulary may lack some of the 256 byte
tokens (SmolLM2-135M lacks 21: 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2
0xF5-0xFF). llama.cpp silently drops such bytes. ember produces the same ids (the
bytes are dropped, nothing else is substituted: mapping them to the unknown id
would inject e.g. ``<|endoftext|>`` into the prompt) but never silently: every
drop is logged as a warning on the ``ember.tokenizer`` logger naming the
characters and positions, ``find_unencodable`` reports them ahead of time, and
``encode(..., strict=True)`` raises ``TokenizerError`` instead. Of SmolLM2's
missing bytes, six are ASCII control characters, 0xF1/0xF2 lead the unassigned
code points U+40000-U+BFFFF (their continuation bytes still encode, so such a
character decodes as U+FFFD), and the rest never occur in UTF-8. Lone surrogates
(which cannot be UTF-8 encoded) are replaced by U+FFFD, also with a warning.
WordPiece has no byte tokens: as in llama.cpp, a word it cannot cover becomes the
unknown token (``[UNK]``), and its normalization drops control characters and
accents, so for it ``decode(encode(text))`` is not ``text``.

Decoding works on bytes: ``token_bytes(id)`` is what a token stands for (as
llama.cpp's ``token_to_piece`` with ``special=True``), ``decode`` joins them and
decodes UTF-8 with U+FFFD replacement. (For WordPiece, whose GGUF stores ``▁word``
and continuation pieces bare, that yields `` hello world`` with continuations
joined; llama.cpp's ``llama_detokenize`` additionally removes spaces before some
punctuation, which ember does for no vocabulary.) ``IncrementalDetokenizer`` streams
the same text without ever emitting half a character.
"""

from __future__ import annotations

import codecs
import functools
import logging
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Any

import numpy as np

from ember.errors import TokenizerError

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

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

# Pre-tokenizer regexes per llama.cpp pre-type (applied in sequence; matches and
# the gaps between them both become pieces). Written from llama.cpp's
# llm_tokenizer_bpe constructor.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# qwen35 (Qwen 3.5): as qwen2, but letter runs also take combining marks (\p{M}), so a
# base letter and its accents stay one piece (and a mark is never split off as punctuation).
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_CJK = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# deepseek-llm: letters of the scripts its tokenizer was trained on (as llama.cpp
# lists them; not \p{L}), then ASCII and full-width punctuation, trailing space,
# CJK runs and digit runs.
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-"
    r"\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-"
    r"\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    r"\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    r"\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    r"\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    r"\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    r"\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    r"\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    r"\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    r"\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    r"\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    r"\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    r"\U000118df\U0001e900-\U0001e943]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+\Z",  # ECMAScript's $ (llama.cpp's std::regex): the end of the text only
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
# gemma4: no word splitting, only lines apart from newline runs (BPE merges then run
# on whole lines of ▁-escaped text). llama.cpp also takes a newline run that is a token
# whole instead of merging it (ggml-org/llama.cpp#21343); for Gemma 4's vocabulary the
# merges give those same tokens (checked against llama.cpp for 1-79 newlines), so
# ember does not special-case them.
_NEWLINE_RUNS = r"[^\n]+|\n+"
# tekken (Mistral Nemo, Small 3, Ministral 3): words split at case changes. llama.cpp
# runs its own spelling of tokenizer.json's regex (upper: a letter not a-z, lower: a
# letter not A-Z, so other scripts' letters are both), and so does ember.
# gpt-4o (o200k: gpt-oss, Llama 4): tekken's splitting with English contractions kept on
# the word and digits in runs of up to three (llama.cpp's spelling again).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token skips merging
    add_bos: bool = False  # llama.cpp's default when the GGUF lacks add_bos_token
    force_bos: bool = False  # add_bos even where the GGUF says false (llama.cpp: Gemma 4)
    # SentencePiece-style BPE (llama.cpp's byte_encode=false with escape_whitespaces):
    # spaces become "▁", tokens are raw UTF-8 text rather than GPT-2's byte-to-character
    # mapping, and a final piece that is no token falls back to <0xXX> byte tokens.
    spm_style: bool = False


def _pre_types() -> dict[str, _PreTokenizer]:
    """``tokenizer.ggml.pre`` name → pre-tokenizer, grouped as llama.cpp groups them."""
    groups = (
        (("default",), _PreTokenizer(_DEFAULT)),
        (
            ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
            _PreTokenizer((r"\p{N}", _GPT2)),  # every digit alone, then GPT-2
        ),
        (("gpt-2", "phi-2", "mpt", "olmo", "jais", "mellum", "exaone4"), _PreTokenizer((_GPT2,))),
        (
            ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"),
            _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
        ),
        (("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
        (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _PreTokenizer((_QWEN2,))),
        (("qwen35",), _PreTokenizer((_QWEN35,))),
        (("tekken",), _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
        (("gpt-4o", "llama4", "kanana2", "talkie"), _PreTokenizer((_GPT4O,))),
        (("deepseek-llm",), _PreTokenizer(_DEEPSEEK_LLM)),
        (("deepseek-coder",), _PreTokenizer(_DEEPSEEK_CODER)),
        (("falcon",), _PreTokenizer(_FALCON)),
        # Also what tokenizer model "gemma4" always uses, whatever its pre says.
        (
            ("gemma4",),
            _PreTokenizer((_NEWLINE_RUNS,), add_bos=True, force_bos=True, spm_style=True),
        ),
    )
    return {name: pre for names, pre in groups for name in names}


_PRE_TYPES = _pre_types()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_BYTE_DECODE = str.maketrans({c: chr(b) for b, c in _BYTE_TO_CHAR.items()})


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
        backend_cls = _BACKENDS.get(self.model)
        if backend_cls is None:
            raise TokenizerError(
                f"unsupported tokenizer model {self.model!r} (ember supports "
                f"{', '.join(repr(m) for m in _BACKENDS)})"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF has no tokenizer.ggml.tokens")
        self._tokens: list[str] = list(tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            types = np.full(len(tokens), NORMAL, dtype=np.int32)
        self._types = np.asarray(types, dtype=np.int32).copy()
        if len(self._types) != len(self._tokens):
            raise TokenizerError(
                f"token_type has {len(self._types)} entries for {len(self._tokens)} tokens"
            )
        # Later duplicates win, as in llama.cpp's token_to_id map.
        self._token_to_id = {t: i for i, t in enumerate(self._tokens)}
        self._read_special_ids(metadata, backend_cls.default_ids)
        self._backend: _Backend = backend_cls(self, metadata)
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
        types = self._types.tolist()
        self._control_ids = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN))
        user = [i for i, t in enumerate(types) if t == USER_DEFINED]
        # Plain text: user-defined tokens only. Chat prompts: control/unknown too.
        self._always = _SpecialMatcher(self._tokens, user)
        self._with_control = _SpecialMatcher(self._tokens, sorted(self._control_ids) + user)

    def _force_control(self, tid: int) -> None:
        # llama.cpp overrides the type of end-marker tokens to CONTROL so user
        # text can never produce them.
        if self._types[tid] != CONTROL:
            log.info(  # llama.cpp warns too; a known quirk of Gemma's </s>, nothing to do
                "token %d %r is not control-type; treating it as control", tid, self._tokens[tid]
            )
            self._types[tid] = CONTROL

    def _read_special_ids(self, metadata: dict[str, Any], defaults: dict[str, int]) -> None:
        """Special ids from the GGUF, else the tokenizer model's llama.cpp defaults."""
        n = len(self._tokens)

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
        by_text = self._token_to_id
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
        if s_id in eog and any(self._tokens[i] in _OWN_EOS_MARKERS for i in eog):
            eog.discard(s_id)
            forced.discard(s_id)
            self._types[s_id] = NORMAL
        # o200k_harmony (gpt-oss), solar-open: "<|end|>" closes a message, not the reply,
        # where the calls' and returns' markers end it; llama.cpp then takes "<|end|>"
        # out of the end markers and makes it user-defined (rendered as text).
        texts = {self._tokens[i] for i in eog}
        end_id = by_text.get("<|end|>")
        if end_id in eog and ({"<|return|>", "<|call|>"} <= texts
                              or ({"<|call|>", "<|calls|>"} & texts and "<|flush|>" in texts)):
            eog.discard(end_id)
            forced.discard(end_id)
            self._types[end_id] = USER_DEFINED
        for tid in forced:
            self._force_control(tid)
        self.eog_ids: frozenset[int] = frozenset(eog)

    # ----------------------------------------------------------------- queries
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

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
        return self._tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for; control tokens give their text."""
        return self._token_bytes[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        """The GGUF token type (NORMAL, CONTROL, USER_DEFINED, ...)."""
        return int(self._types[self._check_id(token_id)])

    def is_control(self, token_id: int) -> bool:
        """True for control and unknown tokens (never produced from plain text)."""
        return token_id in self._control_ids

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} outside vocabulary of {len(self._tokens)}")
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
        self._tokens = tokens
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
        order = sorted(found, key=lambda t: (-len(self._tokens[t].encode()), t))
        for tid in order:
            needle = self._tokens[tid]
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


def _utf8_class(missing: Iterable[int]) -> str:
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


class _BpeBackend:
    """BPE through ``tokenizers`` (no added tokens: plain text only).

    Byte-level (GPT-2 style) for ``gpt2`` vocabularies; SentencePiece style (raw UTF-8,
    ``▁`` for spaces, ``<0xXX>`` fallback) for pre-tokenizers with ``spm_style``.
    """

    default_ids: dict[str, int] = {}  # llama.cpp has none for BPE: all from the GGUF

    def __init__(self, owner: Tokenizer, metadata: dict[str, Any]) -> None:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        pre_name = metadata.get("tokenizer.ggml.pre")
        if owner.model == "gemma4":
            pre_name = "gemma4"  # llama.cpp ignores the GGUF's pre for this model
        elif pre_name is None:
            log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' regexes")
            pre_name = "default"
        pre = _PRE_TYPES.get(str(pre_name))
        if pre is None:
            raise TokenizerError(
                f"unsupported BPE pre-tokenizer {pre_name!r} "
                f"(supported: {', '.join(sorted(_PRE_TYPES))})"
            )
        merges = metadata.get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("BPE GGUF has no tokenizer.ggml.merges")
        self.owner = owner
        self.pre = pre
        self.add_bos = pre.add_bos
        self.force_bos = pre.force_bos
        vocab = owner._token_to_id
        bpe = models.BPE(
            vocab=vocab,
            merges=[pair for pair in map(_split_merge, merges) if pair is not None],
            ignore_merges=pre.ignore_merges,
            byte_fallback=pre.spm_style,
        )
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
            self.missing_bytes = frozenset(b for b, c in _BYTE_TO_CHAR.items() if c not in vocab)
        cls = _utf8_class(self.missing_bytes)
        self._suspect = re.compile(cls) if cls else None

    def encode(self, text: str, *, after_special: bool) -> list[int]:
        if self.pre.spm_style:
            text = text.replace(" ", "\u2581")
        return self.hf.encode(text, add_special_tokens=False).ids

    def find_unencodable(self, text: str) -> list[tuple[int, str]]:
        if self._suspect is None:
            return []
        missing, vocab = self.missing_bytes, self.owner._token_to_id
        return [
            (m.start(), m.group())
            for m in self._suspect.finditer(text)
            if any(b in missing for b in m.group().encode())
            # SentencePiece style: only a character that is no token falls back to bytes.
            and not (self.pre.spm_style and m.group().replace(" ", "\u2581") in vocab)
        ]

    def token_bytes_table(self) -> list[bytes]:
        """Bytes per id: byte-level pieces un-mapped; special tokens' raw text."""
        tokens, types = self.owner._tokens, self.owner._types.tolist()
        if self.pre.spm_style:
            return _sentencepiece_token_bytes(tokens, types)
        table = [b"" if ty == UNUSED else t.encode() for t, ty in zip(tokens, types, strict=True)]
        normal = [i for i, ty in enumerate(types) if ty in (NORMAL, BYTE)]
        # Un-map all byte-level pieces in one translate/encode pass (49k tokens in
        # a few ms), then slice: each piece character stands for exactly one byte.
        joined = "".join(tokens[i] for i in normal).translate(_BYTE_DECODE)
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
        return piece.translate(_BYTE_DECODE).encode("latin-1")
    except UnicodeEncodeError:  # not byte-level text: keep it as UTF-8
        return piece.encode()


class _SpmBackend:
    """llama.cpp's SPM algorithm: merge the adjacent pair whose result has the best
    score, repeatedly; pieces that are not tokens fall back to ``<0xXX>`` tokens."""

    # Only what the GGUF names: llama.cpp's fallbacks (BOS 1, EOS 2, UNK 0) are not applied.
    default_ids: dict[str, int] = {}

    def __init__(self, owner: Tokenizer, metadata: dict[str, Any]) -> None:
        self.owner = owner
        self.add_bos = True
        self.force_bos = False
        self.add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        scores = metadata.get("tokenizer.ggml.scores")
        n = len(owner._tokens)
        self._scores: list[float] = (
            np.asarray(scores, dtype=np.float64).tolist() if scores is not None else [0.0] * n
        )
        vocab = owner._token_to_id
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
        vocab, scores = self.owner._token_to_id, self._scores
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
        vocab, out = self.owner._token_to_id, []
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
        vocab, missing = self.owner._token_to_id, self.missing_bytes
        # Conservative: a character that is not itself a token may need byte fallback.
        return [
            (i, c)
            for i, c in enumerate(text)
            if c not in vocab and any(b in missing for b in c.encode())
        ]

    def token_bytes_table(self) -> list[bytes]:
        return _sentencepiece_token_bytes(self.owner._tokens, self.owner._types.tolist())


def _sentencepiece_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
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


class _WpmBackend:
    """WordPiece as llama.cpp's WPM tokenizer: normalize, split into words at whitespace
    and around punctuation / CJK characters, then cover ``"▁" + word`` left to right by
    the longest tokens; a word that cannot be covered becomes the unknown token.

    The GGUF stores BERT's ``word`` as ``▁word`` and its ``##piece`` continuations as
    ``piece``, so decoding (``▁`` → space) joins continuations to the word before them.
    """

    default_ids = {"bos": 101, "unknown": 100, "padding": 0}  # llama.cpp's for "bert"

    def __init__(self, owner: Tokenizer, metadata: dict[str, Any]) -> None:
        self.owner = owner
        self.add_bos = True  # BERT's [CLS] (llama.cpp also appends [SEP]; ember does not)
        self.force_bos = False
        self.missing_bytes: frozenset[int] = frozenset()  # nothing dropped: [UNK] instead
        self.lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
        self.strip_accents = bool(
            metadata.get("tokenizer.ggml.normalizer.strip_accents", self.lowercase)
        )
        if owner.unk_id is None:
            raise TokenizerError("WPM vocabulary without an unknown token")
        self._unk = owner.unk_id
        self._max_len = max(len(t) for t in owner._tokens)

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
        vocab, ids = self.owner._token_to_id, []
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
        return _sentencepiece_token_bytes(self.owner._tokens, self.owner._types.tolist())


# tokenizer.ggml.model → implementation; "gemma4" is BPE with its own pre-tokenizer.
_Backend = _BpeBackend | _SpmBackend | _WpmBackend
_BACKENDS: dict[str, type[_Backend]] = {
    "gpt2": _BpeBackend,
    "gemma4": _BpeBackend,
    "llama": _SpmBackend,
    "bert": _WpmBackend,
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
