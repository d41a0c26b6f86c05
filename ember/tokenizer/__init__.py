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
``PRE_TYPES`` (``ember/tokenizer/pretokenizers.py``), raises ``TokenizerError`` naming it.

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

from ember.tokenizer.base import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED
from ember.tokenizer.vocab import EOG_TEXTS, IncrementalDetokenizer, Tokenizer

__all__ = ["BYTE", "CONTROL", "EOG_TEXTS", "NORMAL", "UNKNOWN", "UNUSED", "USER_DEFINED",
           "IncrementalDetokenizer", "Tokenizer"]
