"""Pre-tokenizers: how a BPE vocabulary's text is cut into pieces before merging, per
llama.cpp pre-type (``tokenizer.ggml.pre``), written from llama.cpp's
``llm_tokenizer_bpe`` constructor."""

from __future__ import annotations

from dataclasses import dataclass

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
    r"\uff21-\uff3a\uff41-\uff5a"
    # astral code points as the characters themselves (not raw): Oniguruma, the regex
    # engine of the tokenizers library, reads \uXXXX but not \UXXXXXXXX, and took
    # "\U000..." for the letters U, 0, 0, ... (a range from "0" to "U" that swallowed
    # :;<=>?@ and split "):", "://" or "|>" apart where llama.cpp keeps them whole)
    "\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    "\U000118df\U0001e900-\U0001e943]+",
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
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token skips merging
    add_bos: bool = False  # llama.cpp's default when the GGUF lacks add_bos_token
    force_bos: bool = False  # add_bos even where the GGUF says false (llama.cpp: Gemma 4)
    # SentencePiece-style BPE (llama.cpp's byte_encode=false with escape_whitespaces):
    # spaces become "▁", tokens are raw UTF-8 text rather than GPT-2's byte-to-character
    # mapping, and a final piece that is no token falls back to <0xXX> byte tokens.
    spm_style: bool = False


def pre_types() -> dict[str, PreTokenizer]:
    """``tokenizer.ggml.pre`` name → pre-tokenizer, grouped as llama.cpp groups them."""
    groups = (
        (("default",), PreTokenizer(_DEFAULT)),
        (
            ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
            PreTokenizer((r"\p{N}", _GPT2)),  # every digit alone, then GPT-2
        ),
        (("gpt-2", "phi-2", "mpt", "olmo", "jais", "mellum", "exaone4"), PreTokenizer((_GPT2,))),
        (
            ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"),
            PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
        ),
        (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
        (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), PreTokenizer((_QWEN2,))),
        (("qwen35",), PreTokenizer((_QWEN35,))),
        (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
        (("gpt-4o", "llama4", "kanana2", "talkie"), PreTokenizer((_GPT4O,))),
        (("deepseek-llm",), PreTokenizer(_DEEPSEEK_LLM)),
        (("deepseek-coder",), PreTokenizer(_DEEPSEEK_CODER)),
        (("falcon",), PreTokenizer(_FALCON)),
        # Also what tokenizer model "gemma4" always uses, whatever its pre says.
        (
            ("gemma4",),
            PreTokenizer((_NEWLINE_RUNS,), add_bos=True, force_bos=True, spm_style=True),
        ),
    )
    return {name: pre for names, pre in groups for name in names}


PRE_TYPES = pre_types()
