"""What ends a request's output: stop tokens, stop strings and the length limits.

A request's :class:`Stops` are fixed when it is prepared; the commit
(:mod:`ember.engine.commit`) asks them about each token it appends, and the
streaming of text asks how much of a tail to hold back while it could still
become a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ember.sampling.params import SamplingParams


@dataclass(frozen=True)
class Stops:
    token_ids: frozenset[int]  # end-of-generation ids (unless ignored) and stop_token_ids
    strings: tuple[str, ...] = ()  # stop strings: the text ends before the first found
    max_output: int | None = None  # max_tokens
    max_total: int = 1 << 62  # the context window: prompt + output

    @classmethod
    def of(cls, params: SamplingParams, eos_ids: Iterable[int], max_total: int) -> Stops:
        ends = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            ends |= frozenset(eos_ids)
        return cls(ends, tuple(params.stop), params.max_tokens, max_total)

    def at_length(self, num_output: int, total: int) -> bool:
        """Whether the output has reached max_tokens or the history the context window."""
        return (self.max_output is not None and num_output >= self.max_output) or (
            total >= self.max_total)

    def cut(self, text: str, emitted: int) -> tuple[int, str] | None:
        """Where the first stop string in ``text`` starts, and which one it is; None if
        there is none. Only the tail that a new token can have completed is searched:
        text already streamed (``emitted`` characters) held no stop string."""
        if not self.strings:
            return None
        window = max(0, emitted - max(len(s) for s in self.strings))
        hits = [(i, s) for s in self.strings if (i := text.find(s, window)) >= 0]
        return min(hits) if hits else None

    def held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string
        (not safe to stream until it completes the stop string or turns out not to)."""
        best = 0
        for s in self.strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
