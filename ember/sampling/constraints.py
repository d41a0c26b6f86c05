"""Constrained decoding: grammar masks through the sampler's logit-processor seam.

A :class:`StructuredOutput` (JSON schema, any JSON object, regex, or Lark grammar)
is compiled by llguidance into a matcher. Each request gets its own copy of the
compiled matcher, wrapped as a :class:`GrammarProcessor`:

- ``process(logits, history)`` computes the matcher's token bitmask and sets every
  forbidden logit to -inf before penalties, temperature and the draw (so greedy,
  sampled, batched and speculative paths are all constrained alike);
- ``commit(token)`` advances the matcher by the committed token, exactly once per
  token; a token the grammar rejects is a :class:`GrammarError`, never ignored;
- ``forced_tokens()`` / ``valid_prefix_len(tokens)`` expose the grammar's look-ahead
  for speculative drafting.

Control tokens (``<|im_end|>``...) are given to llguidance as special tokens, which
no grammar lexeme can produce: a JSON string containing the text ``<|im_end|>`` is
spelled with ordinary tokens and cannot end the turn. When the grammar is complete
the mask admits only the end-of-turn token, so the reply ends there.

Compiling is the expensive part (milliseconds to seconds); compiled matchers are kept
in an LRU keyed by the grammar's source, so a repeated schema costs only a copy.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ember.errors import EmberError
from ember.tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "lark"]

# Compact JSON by default: no optional whitespace, so outputs are short and a greedy
# model cannot wander into endless indentation.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(EmberError, ValueError):
    """The grammar or schema is invalid, or the matcher entered an error state (for
    example a grammar that turns out too complex mid-generation)."""

    param = "structured"  # the request parameter at fault


class NoLegalToken(EmberError):
    """The grammar allows no token at all here (the request fails, others continue)."""

    param = "structured"


# llguidance's default limits, without the parser state and grammar it appends to
# error messages (they can run to kilobytes and would be echoed to clients).
def _limits(llg: Any) -> Any:
    return llg.LLParserLimits(verbose_errors=False)


def _short(error: str | None, fallback: str) -> str:
    """The first line of a matcher error, bounded (the rest is internal state)."""
    lines = (error or "").strip().splitlines()
    line = lines[0] if lines else fallback
    return line if len(line) <= 300 else line[:297] + "..."


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be. Build with the classmethods."""

    kind: Kind
    source: str  # schema as compact JSON text, the regex, or the Lark grammar

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"JSON schema must be an object, got {type(schema).__name__}")
        # Key order is kept: llguidance emits properties in the schema's order.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object", '{"type":"object"}')

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("lark", grammar)


class GrammarProcessor:
    """One request's grammar state; a LogitProcessor for the sampler."""

    def __init__(self, matcher: Any, vocab_size: int, describe: str) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.describe = describe
        self._bits = np.arange(8, dtype=np.uint8)
        self.mask_seconds = 0.0  # computing masks, all told (the request's trace shows it)

    def allowed(self) -> torch.Tensor:
        """Boolean mask (vocab,) of the tokens the grammar accepts next."""
        start = time.perf_counter()
        raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        bits = np.unpackbits(raw, bitorder="little")[: self.vocab_size]
        mask = torch.from_numpy(bits.astype(bool))
        self.mask_seconds += time.perf_counter() - start
        return mask

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        mask = self.allowed()
        n = min(mask.numel(), logits.numel())
        if not bool(mask[:n].any()):
            raise NoLegalToken(f"{self.describe}: the grammar allows no token here")
        out = torch.full_like(logits, float("-inf"))
        out[:n] = torch.where(mask[:n], logits[:n], out[:n])
        return out

    def commit(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            error = _short(self.matcher.get_error(), "not allowed by the grammar")
            raise GrammarError(f"{self.describe}: token {token} rejected: {error}")

    def lookahead(self, token: int) -> None:
        """Advance as if ``token`` were committed (speculative verification); undone by
        :meth:`rollback`. A token the grammar rejects is a GrammarError."""
        if not self.matcher.consume_token(token):
            error = _short(self.matcher.get_error(), "not allowed by the grammar")
            raise GrammarError(f"{self.describe}: draft token {token} rejected: {error}")

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens consumed by :meth:`lookahead`."""
        if n and not self.matcher.rollback(n):
            raise GrammarError(f"{self.describe}: cannot roll back {n} tokens")

    def reset(self) -> None:
        self.matcher.reset()

    def forced_tokens(self) -> list[int]:
        """The continuation the grammar mandates from here (may be empty)."""
        return list(self.matcher.compute_ff_tokens())

    def valid_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar would accept from here."""
        return int(self.matcher.validate_tokens(list(tokens)))

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"{self.describe}: {_short(self.matcher.get_error(), 'error')}")


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe LRU of compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 64) -> None:
        import llguidance  # deferred: only constrained requests pay the import

        self._llg = llguidance
        self.tokenizer = tokenizer
        self.llg_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
            _LLGVocab(tokenizer)))
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def compile(self, spec: StructuredOutput) -> Any:
        """A pristine matcher for ``spec`` (cached); raises GrammarError if invalid."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        matcher = self._llg.LLMatcher(self.llg_tokenizer, self._grammar(spec), log_level=0,
                                      limits=_limits(self._llg))
        # The first mask builds the lexer, which for a pathological grammar takes
        # seconds or fails: do it here, in the compiling (caller's) thread, not on the
        # engine thread at the request's first step. Copies share the built lexer.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: "
                               f"{_short(matcher.get_error(), 'rejected')}")
        with self._lock:
            self.compiles += 1
            self._cache[spec] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def processor(self, spec: StructuredOutput) -> GrammarProcessor:
        """A fresh per-request processor (a copy of the compiled matcher)."""
        return GrammarProcessor(self.compile(spec).deep_copy(), self.tokenizer.vocab_size,
                                spec.kind.replace("_", " "))

    def _grammar(self, spec: StructuredOutput) -> str:
        M = self._llg.LLMatcher
        try:
            if spec.kind in ("json_schema", "json_object"):
                return M.grammar_from_json_schema(spec.source, overrides=COMPACT_JSON)
            if spec.kind == "regex":
                return M.grammar_from_regex(spec.source)
            return M.grammar_from_lark(spec.source)
        except ValueError as e:
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: "
                               f"{_short(str(e), 'rejected')}") from None


class _LLGVocab:
    """The shape llguidance's TokenizerWrapper reads: token bytes, specials, encode.

    Control tokens get llguidance's 0xFF marker prefix so that they count as special
    tokens, which grammar lexemes can never produce.
    """

    def __init__(self, tok: Tokenizer) -> None:
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_control(i)]
        special = set(self.special_token_ids)
        self.tokens = [b"\xff" + tok.token_bytes(i) if i in special else tok.token_bytes(i)
                       for i in range(tok.vocab_size)]
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)
