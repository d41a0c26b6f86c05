"""One request's draft proposals: sources behind one small protocol, and a cascade.

Losslessness does not depend on anything here. The engine verifies a draft by
sampling each verify row through the one sampling pipeline, conditioned on the
draft tokens before it, with the draw of that output position (see
``ember.sampling.sampler``): it commits the sampled tokens while they equal the
draft, then the first sample that differs (the correction) or, after a fully
accepted draft, the next one (the bonus). A draft — right, wrong, random, or lying
about its length — changes how many tokens a step commits, never which.

Sources (:class:`DraftSource`: ``propose(budget)``, ``observe(committed)``, and the
optional ``observe_topk`` whose absence lets the engine skip computing top-k):

- ``conversation``: a suffix automaton over the request's own tokens (prompt and
  output): the longest suffix that occurred before, drafting what followed its most
  recent occurrence;
- ``reference``: cursors over frozen automata of reference documents (per request
  or per server), shared read-only;
- ``recycling``: the top-1 chain of the tenant's table of recent top-k successors,
  fed from verification logits;
- a grammar's forced continuation comes first (certain), and any draft is cut at the
  first token the grammar would reject.

The cascade: the source with the longest match wins (ties: the conversation); its
budget grows with the match (2 · (1 + length)); matches shorter than 2 fall back to
recycling. Each source keeps a window over its last 64 drafted tokens and is muted
when fewer than a fifth were accepted — for 128 committed tokens, doubling with each
mute up to 1,024 — then re-probed; a muted source keeps observing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ember.spec.index import RecyclingTable, ReferenceCursor, StreamMatcher, SuffixAutomaton

WINDOW = 64  # drafted tokens an acceptance rate is measured over
MIN_RATE = 0.2  # below this a source is muted
MUTE_STEPS = 128  # committed tokens of a first mute; doubles up to MAX_MUTE
MAX_MUTE = 1024
TOPK = 8
REFUSALS_PER_GAP = 4  # proposals in a row without a draft that double the proposal gap
MAX_PROPOSE_GAP = 7  # steps skipped at most between two proposals
PENDING_LIMIT = 64  # committed tokens held back from the indexes at most
RECYCLING_DRAFT = 4  # tokens of a top-1 successor chain worth verifying
PRIOR_WEIGHT = 4  # drafted tokens' worth of trust in a source's prior acceptance


def prior_acceptance(source: str, match: int) -> float:
    """Acceptance expected before evidence: an index's long match is a strong hint that
    the text goes on as before; a recycled successor chain is a weak one."""
    if source == "recycling":
        return 0.2
    return match / (match + 3)  # 2 tokens matched: 0.4; 8: 0.73; 20: 0.87


@dataclass
class Proposal:
    """Draft tokens, the source that proposed them, and for each token the estimated
    probability that it and every token before it are accepted."""

    tokens: list[int]
    source: str
    reach: list[float]
    forced: int = 0  # leading tokens a grammar forces (accepted with certainty)


@dataclass
class SpecStats:
    """What speculation did for one request."""

    drafted: int = 0
    accepted: int = 0
    bonus: int = 0
    verify_steps: int = 0  # steps that verified a draft
    fallback_steps: int = 0  # steps with nothing to draft
    off_steps: int = 0  # steps where a draft existed but the gate declined it
    by_source: dict[str, list[int]] = field(default_factory=dict)  # name -> [drafted, accepted]

    def summary(self) -> str:
        steps = self.verify_steps + self.fallback_steps + self.off_steps
        rate = self.accepted / self.drafted if self.drafted else 0.0
        sources = " ".join(f"{n}={a}/{d}" for n, (d, a) in sorted(self.by_source.items()))
        return (f"spec: steps={steps} (verify {self.verify_steps}, fallback "
                f"{self.fallback_steps}, off {self.off_steps}) drafted={self.drafted} "
                f"accepted={self.accepted} ({rate:.0%}) bonus={self.bonus}"
                + (f" [{sources}]" if sources else ""))


class DraftSource(Protocol):
    name: str

    def propose(self, budget: int) -> tuple[list[int], int]:
        """Up to ``budget`` draft tokens and the match length that backs them."""
        ...

    def observe(self, committed: Sequence[int]) -> None:
        """Newly committed tokens, in order, muted or not (batched: every commit since the
        last call, given before the next proposal)."""
        ...


class ConversationSource:
    name = "conversation"

    def __init__(self, tokens: Sequence[int]) -> None:
        self.matcher = StreamMatcher(tokens)

    def propose(self, budget: int) -> tuple[list[int], int]:
        return self.matcher.draft(budget), self.matcher.match_len

    def observe(self, committed: Sequence[int]) -> None:
        self.matcher.append(committed)


class ReferenceSource:
    """Cursors over reference documents; the longest match among them drafts."""

    name = "reference"

    def __init__(self, documents: Sequence[SuffixAutomaton], tokens: Sequence[int]) -> None:
        self.cursors = [ReferenceCursor(doc) for doc in documents]
        self.observe(tokens)

    def propose(self, budget: int) -> tuple[list[int], int]:
        best = max(self.cursors, key=lambda c: c.match_len)
        return best.draft(budget), best.match_len

    def observe(self, committed: Sequence[int]) -> None:
        for cursor in self.cursors:
            cursor.advance(committed)


class RecyclingSource:
    """The top-1 chain of recent top-k successors (a table shared by one tenant)."""

    name = "recycling"

    def __init__(self, table: RecyclingTable, last: int) -> None:
        self.table = table
        self.last = last

    def propose(self, budget: int) -> tuple[list[int], int]:
        return self.table.draft_chain(self.last, budget), 0

    def observe(self, committed: Sequence[int]) -> None:
        if committed:
            self.last = committed[-1]

    def observe_topk(self, inputs: Sequence[int], topk: torch.Tensor) -> None:
        """Verification rows: after token ``inputs[i]`` the model ranked ``topk[i]``."""
        self.table.update_many(torch.as_tensor(list(inputs)).numpy(), topk.numpy())


@dataclass
class _Track:
    """A source's recent acceptance and mute state."""

    window: deque = field(default_factory=deque)  # (drafted, accepted) per verify
    drafted: int = 0
    accepted: int = 0
    muted_until: int = 0  # committed-token count at which it is re-probed
    mutes: int = 0

    def rate(self, prior: float) -> float:
        """Acceptance estimate: the window's, pulled toward ``prior`` as if it had been
        seen over PRIOR_WEIGHT tokens (so a first probe is priced by the prior)."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.drafted + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int, committed: int) -> None:
        self.window.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        while self.drafted - self.window[0][0] >= WINDOW:
            d, a = self.window.popleft()
            self.drafted -= d
            self.accepted -= a
        if self.drafted >= WINDOW // 4 and self.accepted < MIN_RATE * self.drafted:
            self.muted_until = committed + min(MAX_MUTE, MUTE_STEPS << self.mutes)
            self.mutes += 1
            self.window.clear()
            self.drafted = self.accepted = 0


class Speculator:
    """The cascade for one request; the engine calls it on its own thread only."""

    def __init__(self, tokens: Sequence[int], *, documents: Sequence[SuffixAutomaton] = (),
                 recycling: RecyclingTable | None = None, grammar: object | None = None,
                 max_draft: int = 16, enders: frozenset[int] = frozenset(),
                 vocab_size: int = 1 << 31) -> None:
        self.sources: list[DraftSource] = [ConversationSource(tokens)]
        if documents:
            self.sources.append(ReferenceSource(documents, tokens))
        if recycling is not None:
            self.sources.append(RecyclingSource(recycling, tokens[-1]))
        self.grammar = grammar  # a GrammarProcessor, or None
        self.max_draft = max_draft
        # Tokens that end a request (end of generation, stop ids). A draft stops before
        # them: rows after the end are never needed, and a grammar cannot look past it.
        self.enders = enders
        self.vocab_size = vocab_size
        self.committed = len(tokens)
        self.tracks = {s.name: _Track() for s in self.sources}
        self.stats = SpecStats()
        self.warm = False  # drafted in its previous step (the gate's hysteresis)
        self.refused = 0  # proposals in a row that drafted nothing (none found, or declined)
        self.declined = False  # the gate turned the last one down (else: none was found)
        self._wait = 0  # steps until it proposes again
        self.wants_topk = any(hasattr(s, "observe_topk") for s in self.sources)
        # Committed tokens not yet given to the sources. Indexing them waits for the next
        # proposal (or PENDING_LIMIT of them): one call for many tokens, on warm caches,
        # instead of a cold one per token after every forward pass; and while the batch
        # is too busy for drafts, proposals are rare.
        self._pending: list[int] = []

    def due(self, rows: int = 1) -> bool:
        """Whether to propose this step, in a step of ``rows`` running requests. After a run
        of proposals that drafted nothing (text no source predicts, or a busy batch whose
        gate declines), only every second step, then every fourth, up to every
        (MAX_PROPOSE_GAP + 1)-th: a proposal costs its lookups, and the gate's pricing
        when it finds one, and buys nothing when nothing is drafted; an occasional probe
        notices when drafts pay again. Lookups that found nothing cost per row, so they
        space proposals at most every ``rows``-th step (a lone stream keeps looking)."""
        if self._wait > 0:
            self._wait -= 1
            return False
        doublings = min(self.refused // REFUSALS_PER_GAP, MAX_PROPOSE_GAP.bit_length())
        cap = MAX_PROPOSE_GAP if self.declined else min(MAX_PROPOSE_GAP, rows - 1)
        self._wait = min(cap, (1 << doublings) - 1)
        return True

    def granted(self, tokens: int) -> None:
        """The gate's answer to this step's proposal: ``tokens`` draft tokens (0: none)."""
        self.warm = tokens > 0
        self.declined = not tokens
        self.refused = 0 if tokens else self.refused + 1
        if tokens:
            self._wait = 0

    def found_nothing(self) -> None:
        """This step's proposal had no draft from any source."""
        self.warm = self.declined = False
        self.refused += 1
        self.stats.fallback_steps += 1

    def propose(self) -> Proposal | None:
        """The cascade's draft for the next step, or None."""
        self._index_pending()
        forced = list(self.grammar.forced_tokens()) if self.grammar is not None else []
        budget = self.max_draft - len(forced)
        best: tuple[int, int, DraftSource, list[int], int] | None = None
        for rank, source in enumerate(self.sources):
            if self.tracks[source.name].muted_until > self.committed or budget <= 0:
                continue
            tokens, match = source.propose(budget)
            tokens = list(tokens)[:budget]  # a source may not draft more than it was asked
            if not tokens or (source.name != "recycling" and match < 2):
                continue
            key = (match, -rank)  # longest match; ties go to the earlier source
            length = 2 * (1 + match)  # a longer match earns a longer draft
            if source.name == "recycling":
                key, length = (1, -rank), RECYCLING_DRAFT  # only when no index matched
            if best is None or key > best[:2]:
                best = (*key, source, tokens[: min(budget, length)], match)
        if not forced and best is None:
            return None
        source_name = best[2].name if best else "grammar"
        tokens = forced + (best[3] if best else [])
        end = next((i for i, t in enumerate(tokens) if t in self.enders
                    or not (isinstance(t, int) and 0 <= t < self.vocab_size)), len(tokens))
        tokens = tokens[:end]
        forced = forced[:end]
        if self.grammar is not None and len(tokens) > len(forced):
            tokens = tokens[: self.grammar.valid_prefix_len(tokens)]
        if not tokens:
            return None
        rate = self.tracks[source_name].rate(prior_acceptance(source_name, best[4])) \
            if best else 1.0
        reach, p = [], 1.0
        for i in range(len(tokens)):
            p *= 1.0 if i < len(forced) else rate
            reach.append(p)
        return Proposal(tokens, source_name, reach, len(forced))

    def observe(self, committed: Sequence[int]) -> None:
        """Newly committed tokens; the sources see them by the next proposal."""
        self._pending += committed
        self.committed += len(committed)
        if len(self._pending) >= PENDING_LIMIT:
            self._index_pending()

    def _index_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            for source in self.sources:
                source.observe(pending)

    def observe_topk(self, inputs: Sequence[int], topk: torch.Tensor) -> None:
        for source in self.sources:
            if hasattr(source, "observe_topk"):
                source.observe_topk(inputs, topk)

    def feedback(self, proposal: Proposal, drafted: int, accepted: int, bonus: bool) -> None:
        """A verify of the first ``drafted`` proposal tokens accepted ``accepted``."""
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.bonus += bonus
        self.stats.verify_steps += 1
        counts = self.stats.by_source.setdefault(proposal.source, [0, 0])
        counts[0] += drafted
        counts[1] += accepted
        unforced = max(0, drafted - proposal.forced)
        if proposal.source in self.tracks and unforced:
            self.tracks[proposal.source].record(
                unforced, max(0, accepted - proposal.forced), self.committed)
