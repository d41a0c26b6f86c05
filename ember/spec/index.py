"""Token indexes for speculative decoding without a draft model.

Three structures, each answering "which tokens are likely to come next?" from text already
seen, never from a model:

- :class:`SuffixAutomaton` indexes a token stream online; a frozen one is a read-only document
  index shared by many requests.
- :class:`StreamMatcher` indexes one request's own stream (prompt + committed tokens) and, after
  every token, finds the longest suffix that occurred before and what followed it.
- :class:`ReferenceCursor` is one request's matching-statistics cursor over a frozen document.
- :class:`RecyclingTable` keeps the top-k successors of each token seen in verification logits
  (Token Recycling) and drafts by walking the top-1 chain.

Contract shared by all drafts: a draft is only ever a guess. Verification decides what is
committed, so a stale or short draft costs acceptance rate, never correctness. What the
indexes do guarantee is that every drafted token really followed an occurrence of the
matched suffix (for the automata) or really was observed as a successor (for the table).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

import numpy as np

from ember.errors import EmberError

LAST_UPDATE_LIMIT = 256
"""Most suffix-link states whose ``last`` one append refreshes.

Refreshing every state on the new state's suffix-link path keeps ``last`` exact, but that path
is as long as the stream for "aaaa…" (and long for any highly periodic text), which makes
indexing O(n²). Past the cap, shorter suffixes keep an older occurrence: still a real one, so
the draft still follows the matched suffix somewhere, just not at its most recent place.
"""


class FrozenIndexError(EmberError, RuntimeError):
    """``extend`` was called on a frozen :class:`SuffixAutomaton`."""


def _check_budget(budget: int) -> int:
    budget = operator.index(budget)
    if budget < 0:
        raise ValueError(f"draft budget must be >= 0, got {budget}")
    return budget


class SuffixAutomaton:
    """Online suffix automaton over a stream of token ids.

    State 0 is the root (the empty string). Per state, parallel lists hold ``length`` (the
    longest substring in the state), ``link`` (suffix link; -1 for the root), ``last`` (end
    position, 0-based, of the most recent occurrence of the state's substrings; see
    :data:`LAST_UPDATE_LIMIT`) and the outgoing transitions (one dict per state: cloning a
    state is one ``dict.copy``, which a global ``(state, token)`` dict cannot do).

    ``extend`` costs amortized O(1) transitions plus at most :data:`LAST_UPDATE_LIMIT` ``last``
    writes. After :meth:`freeze` the automaton is immutable and may be shared by any number of
    :class:`ReferenceCursor` objects.
    """

    def __init__(self) -> None:
        self._length: list[int] = [0]
        self._link: list[int] = [-1]
        self._last: list[int] = [-1]
        self._next: list[dict[int, int]] = [{}]
        self._tail = 0  # the state of the whole stream
        self._tokens: list[int] = []
        self._frozen = False

    def __len__(self) -> int:
        """Number of tokens indexed."""
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """The indexed stream. Returned without a copy (drafts slice it): do not mutate."""
        return self._tokens

    @property
    def frozen(self) -> bool:
        return self._frozen

    def freeze(self) -> None:
        """Make the automaton read-only; later :meth:`extend` calls raise."""
        self._frozen = True

    def extend(self, token: int) -> None:
        """Append one token. Raises TypeError for a non-integer and FrozenIndexError if frozen.

        Both checks happen before any state is touched, so a failed call changes nothing.
        """
        if self._frozen:
            raise FrozenIndexError(f"cannot extend a frozen index with token {token!r}")
        token = operator.index(token)
        length, link, last, nxt = self._length, self._link, self._last, self._next
        pos = len(self._tokens)
        self._tokens.append(token)

        cur = len(length)
        length.append(length[self._tail] + 1)
        link.append(0)
        last.append(pos)
        nxt.append({})
        p = self._tail
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                link[cur] = self._split(p, q, token)
        self._tail = cur
        self._refresh_last(link[cur], pos)

    def _split(self, p: int, q: int, token: int) -> int:
        """Clone ``q`` so the clone holds its strings of length <= length[p] + 1; return it."""
        length, link, last, nxt = self._length, self._link, self._last, self._next
        clone = len(length)
        length.append(length[p] + 1)
        link.append(link[q])
        last.append(last[q])  # same end positions as q so far; refreshed by the caller
        nxt.append(nxt[q].copy())
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = clone
            p = link[p]
        link[q] = clone
        return clone

    def _refresh_last(self, state: int, pos: int) -> None:
        """Record ``pos`` as the latest end of ``state`` and its suffix-link ancestors (capped).

        The root is skipped: its empty string is never drafted from.
        """
        link, last = self._link, self._last
        budget = LAST_UPDATE_LIMIT  # read at call time so tests can lower it
        while state > 0 and budget > 0:
            last[state] = pos
            state = link[state]
            budget -= 1


class StreamMatcher:
    """Index of one request's stream that finds, after each token, its longest repeated suffix.

    ``match_len`` is the length of the longest suffix of the stream that also occurs ending
    strictly before the stream's end; ``draft`` returns what followed its most recent such
    occurrence. Self-matches are excluded by construction: each new token first advances a
    cursor over the automaton of the tokens *before* it, and only then is added to the
    automaton, so a transition the cursor follows proves an earlier occurrence.

    If an :meth:`append` raises midway, the matcher is *degraded*: a half-applied append must
    never serve drafts, so ``match_len`` is 0 and ``draft`` is [] from then on, and later
    appends are ignored.
    """

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._sam = SuffixAutomaton()
        self._state = 0  # cursor: the state holding the matched suffix
        self._match_len = 0
        self._end = -1  # end of the matched suffix's most recent earlier occurrence
        self._degraded = False
        self.append(tokens)

    def __len__(self) -> int:
        return len(self._sam)

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def match_len(self) -> int:
        """Length of the longest suffix that also occurs ending before the current end."""
        return 0 if self._degraded else self._match_len

    def append(self, tokens: Iterable[int]) -> None:
        """Index ``tokens`` one by one; re-raises (and degrades) on a bad token."""
        if self._degraded:
            return
        try:
            for token in tokens:
                self._append_one(operator.index(token))
        except BaseException:
            self._degraded = True
            raise

    def draft(self, budget: int) -> list[int]:
        """Up to ``budget`` tokens that followed the most recent earlier occurrence of the match.

        The draft may be shorter than ``budget`` when that occurrence is near the end.
        """
        budget = _check_budget(budget)
        if self.match_len == 0:
            return []
        start = self._end + 1
        return self._sam.tokens[start : start + budget]

    def _append_one(self, token: int) -> None:
        sam = self._sam
        state, matched = _follow(sam, self._state, self._match_len, token)
        if matched:
            # Read now: once the token is indexed, `last` of this state becomes its own
            # position, which is the occurrence being excluded.
            self._end = sam._last[state]
        sam.extend(token)
        self._match_len = matched
        # extend may have split the cursor's state, leaving the matched suffix in the clone.
        # The new tail's suffix link is, by construction, the state of the longest suffix that
        # occurred before: exactly the cursor's suffix. Re-reading it keeps "the cursor's state
        # holds the matched suffix" exact. (Keeping the split state would also step correctly,
        # as it differs from its clone only by an end with no successor yet; the tests cannot
        # tell the two apart, so this line is for the invariant, not a bug fix.)
        self._state = sam._link[sam._tail]


def _follow(sam: SuffixAutomaton, state: int, matched: int, token: int) -> tuple[int, int]:
    """Matching statistics, one token on: from the state holding a ``matched``-long suffix,
    the state and length of the longest suffix that ``token`` extends (0, 0 if none)."""
    nxt, link, length = sam._next, sam._link, sam._length
    while True:
        target = nxt[state].get(token)
        if target is not None:
            return target, matched + 1
        if state == 0:
            return 0, 0
        state = link[state]
        matched = length[state]


class ReferenceCursor:
    """One request's matching-statistics cursor over a frozen document index.

    After each advanced token the cursor holds the longest suffix of the request's stream
    (the tokens passed to :meth:`advance`) that occurs anywhere in the document. The index is
    only read, so one frozen index serves any number of cursors. Like :class:`StreamMatcher`,
    a cursor whose advance raised midway is degraded and drafts nothing from then on.
    """

    def __init__(self, index: SuffixAutomaton) -> None:
        if not index.frozen:
            raise ValueError(
                f"ReferenceCursor needs a frozen index (freeze() it first); "
                f"got an unfrozen one of {len(index)} tokens"
            )
        self._index = index
        self._state = 0
        self._match_len = 0
        self._degraded = False

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def match_len(self) -> int:
        """Length of the longest suffix of the request's stream found in the document."""
        return 0 if self._degraded else self._match_len

    def advance(self, tokens: Iterable[int]) -> None:
        """Extend the request's stream by ``tokens``; re-raises (and degrades) on a bad token."""
        if self._degraded:
            return
        try:
            for token in tokens:
                self._state, self._match_len = _follow(
                    self._index, self._state, self._match_len, operator.index(token))
        except BaseException:
            self._degraded = True
            raise

    def draft(self, budget: int) -> list[int]:
        """Up to ``budget`` document tokens after an occurrence of the matched suffix.

        The occurrence is the state's ``last`` (the most recent one, up to the
        :data:`LAST_UPDATE_LIMIT` staleness). [] if nothing matches or the occurrence ends the
        document.
        """
        budget = _check_budget(budget)
        if self.match_len == 0:
            return []
        start = self._index._last[self._state] + 1
        return self._index.tokens[start : start + budget]


class RecyclingTable:
    """Top-k successors per token, taken from verification logits (Token Recycling).

    ``table[t]`` holds the k most likely next tokens after ``t`` as last observed, best first,
    with -1 for unknown. Entries are validated to lie in [-1, vocab_size) so that a chain walk
    can never index outside the table (numpy would silently wrap a negative index).
    """

    def __init__(self, vocab_size: int, k: int = 8) -> None:
        if vocab_size <= 0 or k <= 0:
            raise ValueError(f"vocab_size and k must be positive, got {vocab_size} and {k}")
        self.vocab_size = vocab_size
        self.k = k
        self.table = np.full((vocab_size, k), -1, dtype=np.int32)

    def update(self, token: int, successors: Sequence[int]) -> None:
        """Replace ``token``'s row with ``successors`` (best first, at most k; padded with -1)."""
        self._check_token(token)
        row = np.asarray(successors, dtype=np.int64).reshape(-1)
        self._check_successors(row, row.shape[0])
        self.table[token] = -1
        self.table[token, : row.shape[0]] = row

    def update_many(self, tokens: np.ndarray, successors: np.ndarray) -> None:
        """Vectorized :meth:`update`: the same result as updating row by row, in order.

        ``tokens`` has shape (n,), ``successors`` shape (n, m) with m <= k. When a token
        repeats, its last row wins (numpy does not promise an order for repeated indices in an
        assignment, so repeats are removed first).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        successors = np.asarray(successors, dtype=np.int64)
        if tokens.ndim != 1 or successors.ndim != 2 or successors.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"update_many needs tokens (n,) and successors (n, m); "
                f"got {tokens.shape} and {successors.shape}"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"tokens must lie in [0, {self.vocab_size}), got {tokens}")
        self._check_successors(successors, successors.shape[1])
        unique, first_from_end = np.unique(tokens[::-1], return_index=True)
        rows = successors[::-1][first_from_end]
        self.table[unique] = -1
        self.table[unique, : rows.shape[1]] = rows

    def successors(self, token: int) -> list[int]:
        """The known successors of ``token``, best first."""
        self._check_token(token)
        return [int(t) for t in self.table[token] if t >= 0]

    def draft_chain(self, start: int, budget: int) -> list[int]:
        """Follow top-1 successors from ``start`` for up to ``budget`` tokens.

        Stops early at an unknown (-1) entry; a cycle simply repeats until the budget is spent.
        """
        self._check_token(start)
        budget = _check_budget(budget)
        top1 = self.table[:, 0]
        out: list[int] = []
        token = start
        while len(out) < budget:
            token = int(top1[token])
            if token < 0:
                break
            out.append(token)
        return out

    def _check_token(self, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token must lie in [0, {self.vocab_size}), got {token}")

    def _check_successors(self, successors: np.ndarray, width: int) -> None:
        if width > self.k:
            raise ValueError(f"at most k={self.k} successors per token, got {width}")
        if successors.size and (successors.min() < -1 or successors.max() >= self.vocab_size):
            raise ValueError(
                f"successors must lie in [-1, {self.vocab_size}), got {successors.tolist()}"
            )
