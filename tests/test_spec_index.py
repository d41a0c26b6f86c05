"""Token indexes for draft-model-free speculative decoding, against brute-force oracles."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.spec import index as index_module
from ember.spec.index import (
    FrozenIndexError,
    RecyclingTable,
    ReferenceCursor,
    StreamMatcher,
    SuffixAutomaton,
)

# ---------------------------------------------------------------- brute-force oracles


def brute_prior_match(stream: list[int]) -> tuple[int, int]:
    """(L, e): the longest L whose L-token suffix also ends at some j < n-1, and the largest j.

    (0, -1) when no suffix occurred before. O(n^3) worst case; fine for short streams.
    """
    n = len(stream)
    for length in range(n - 1, 0, -1):
        suffix = stream[n - length :]
        for j in range(n - 2, length - 2, -1):
            if stream[j - length + 1 : j + 1] == suffix:
                return length, j
    return 0, -1


def brute_match_len(stream: list[int]) -> int:
    return brute_prior_match(stream)[0]


def brute_draft(stream: list[int], budget: int) -> list[int]:
    length, end = brute_prior_match(stream)
    return stream[end + 1 : end + 1 + budget] if length else []


def brute_doc_match(doc: list[int], query: list[int]) -> tuple[int, int]:
    """(L, e): the longest suffix of ``query`` occurring in ``doc``, and its last end there."""
    for length in range(min(len(query), len(doc)), 0, -1):
        suffix = query[len(query) - length :]
        for j in range(len(doc) - 1, length - 2, -1):
            if doc[j - length + 1 : j + 1] == suffix:
                return length, j
    return 0, -1


def follows_some_occurrence(
    text: list[int], suffix: list[int], draft: list[int], end_before: int
) -> bool:
    """True if ``draft`` is what follows some occurrence of ``suffix`` ending before end_before."""
    n = len(suffix)
    return any(
        text[j - n + 1 : j + 1] == suffix and text[j + 1 : j + 1 + len(draft)] == draft
        for j in range(n - 1, end_before)
    )


# ---------------------------------------------------------------- strategies


@st.composite
def chunked_streams(draw, max_len: int = 60) -> tuple[list[list[int]], list[int]]:
    """A stream over a 2-4 symbol alphabet, split into chunks (mostly single tokens)."""
    alphabet = draw(st.integers(2, 4))
    stream = draw(st.lists(st.integers(0, alphabet - 1), max_size=max_len))
    chunks, i = [], 0
    while i < len(stream):
        size = draw(st.sampled_from([1, 1, 1, 2, 3, 7]))
        chunks.append(stream[i : i + size])
        i += size
    budgets = draw(st.lists(st.integers(0, 10), min_size=len(chunks), max_size=len(chunks)))
    return chunks, budgets


# ---------------------------------------------------------------- StreamMatcher


def test_stream_matcher_example():
    m = StreamMatcher([5, 6, 7, 5, 6])
    assert m.match_len == 2
    assert m.draft(8) == [7, 5, 6]
    assert m.draft(1) == [7]
    assert m.draft(0) == []


def test_stream_matcher_never_matches_itself():
    m = StreamMatcher()
    for token in [1, 2, 3, 4]:
        m.append([token])
        assert m.match_len == 0 and m.draft(4) == []


@settings(max_examples=300, deadline=None)
@given(case=chunked_streams())
def test_stream_matcher_agrees_with_brute_force_after_every_append(case):
    chunks, budgets = case
    m, stream = StreamMatcher(), []
    for chunk, budget in zip(chunks, budgets, strict=True):
        m.append(chunk)
        stream += chunk
        assert m.match_len == brute_match_len(stream), stream
        assert m.draft(budget) == brute_draft(stream, budget), (stream, budget)
    assert len(m) == len(stream)


@settings(max_examples=150, deadline=None)
@given(case=chunked_streams(), cap=st.integers(0, 3))
def test_stream_matcher_past_the_last_cap_drafts_a_real_earlier_continuation(case, cap):
    """With `last` refreshed for only `cap` states, match_len stays exact and every draft
    still follows an earlier occurrence of the matched suffix (just maybe not the latest)."""
    chunks, budgets = case
    with mock.patch.object(index_module, "LAST_UPDATE_LIMIT", cap):
        m, stream = StreamMatcher(), []
        for chunk, budget in zip(chunks, budgets, strict=True):
            m.append(chunk)
            stream += chunk
            length = brute_match_len(stream)
            assert m.match_len == length
            draft = m.draft(budget)
            if length:
                assert (draft != []) == (budget > 0)  # an earlier occurrence has a successor
                suffix = stream[len(stream) - length :]
                assert follows_some_occurrence(stream, suffix, draft, len(stream) - 1)
            else:
                assert draft == []


def test_stream_matcher_on_repetitive_streams_is_exact_and_completes():
    """5000 identical tokens would cost ~12.5M `last` writes uncapped; the cap bounds it."""
    n = 5000
    m = StreamMatcher([1] * n)
    assert m.match_len == n - 1
    assert m.draft(8) == [1]

    m = StreamMatcher([1, 2] * 3000)
    assert m.match_len == 6000 - 2
    assert m.draft(8) == [1, 2]


def test_stream_matcher_stale_last_still_drafts_a_real_continuation():
    """Past the cap the shortest suffixes keep an old occurrence: valid, if less useful."""
    stream = [1] * 600 + [2, 1]
    m = StreamMatcher(stream)
    assert m.match_len == 1
    draft = m.draft(8)
    assert draft and follows_some_occurrence(stream, [1], draft, len(stream) - 1)


def test_a_failed_append_degrades_the_matcher_for_good():
    m = StreamMatcher([1, 2, 3, 1, 2])
    assert m.match_len == 2 and not m.degraded
    with pytest.raises(TypeError):
        m.append([3, "x", 4])  # 3 alone would make match_len 3 and draft [1, 2]
    assert m.degraded
    assert m.match_len == 0 and m.draft(4) == []
    m.append([1, 2, 3])  # ignored: the stream is no longer known
    assert m.match_len == 0 and m.draft(4) == []


def test_stream_matcher_accepts_numpy_integers():
    m = StreamMatcher(np.array([5, 6, 7, 5, 6], dtype=np.int64))
    assert m.match_len == 2 and m.draft(8) == [7, 5, 6]


def test_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="-1"):
        StreamMatcher([1, 1]).draft(-1)


# ---------------------------------------------------------------- SuffixAutomaton


def test_extend_after_freeze_raises_and_changes_nothing():
    sam = SuffixAutomaton()
    for t in [1, 2, 3]:
        sam.extend(t)
    sam.freeze()
    assert sam.frozen
    with pytest.raises(FrozenIndexError):
        sam.extend(4)
    assert len(sam) == 3 and sam.tokens == [1, 2, 3]


def test_extend_rejects_a_non_integer_before_touching_state():
    sam = SuffixAutomaton()
    sam.extend(1)
    with pytest.raises(TypeError):
        sam.extend(1.5)
    assert sam.tokens == [1]


# ---------------------------------------------------------------- ReferenceCursor


def frozen_index(tokens: list[int]) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    for t in tokens:
        sam.extend(t)
    sam.freeze()
    return sam


def test_reference_cursor_requires_a_frozen_index():
    sam = SuffixAutomaton()
    sam.extend(1)
    with pytest.raises(ValueError, match="frozen"):
        ReferenceCursor(sam)


@st.composite
def doc_and_query(draw) -> tuple[list[int], list[list[int]], list[int]]:
    alphabet = draw(st.integers(2, 4))
    doc = draw(st.lists(st.integers(0, alphabet - 1), max_size=60))
    query = draw(st.lists(st.integers(0, alphabet), max_size=40))  # `alphabet` is not in doc
    chunks, i = [], 0
    while i < len(query):
        size = draw(st.sampled_from([1, 1, 1, 2, 5]))
        chunks.append(query[i : i + size])
        i += size
    budgets = draw(st.lists(st.integers(0, 10), min_size=len(chunks), max_size=len(chunks)))
    return doc, chunks, budgets


@settings(max_examples=300, deadline=None)
@given(case=doc_and_query())
def test_reference_cursor_agrees_with_brute_force_after_every_advance(case):
    doc, chunks, budgets = case
    cursor, query = ReferenceCursor(frozen_index(doc)), []
    for chunk, budget in zip(chunks, budgets, strict=True):
        cursor.advance(chunk)
        query += chunk
        length, end = brute_doc_match(doc, query)
        assert cursor.match_len == length, (doc, query)
        expected = doc[end + 1 : end + 1 + budget] if length else []
        assert cursor.draft(budget) == expected, (doc, query, budget)


@settings(max_examples=100, deadline=None)
@given(case=doc_and_query(), cap=st.integers(0, 3))
def test_reference_cursor_past_the_last_cap_drafts_a_real_continuation(case, cap):
    doc, chunks, budgets = case
    with mock.patch.object(index_module, "LAST_UPDATE_LIMIT", cap):
        index = frozen_index(doc)
    cursor, query = ReferenceCursor(index), []
    for chunk, budget in zip(chunks, budgets, strict=True):
        cursor.advance(chunk)
        query += chunk
        length, _ = brute_doc_match(doc, query)
        assert cursor.match_len == length
        draft = cursor.draft(budget)
        if length:
            suffix = query[len(query) - length :]
            assert follows_some_occurrence(doc, suffix, draft, len(doc))
        else:
            assert draft == []


def test_one_frozen_index_serves_independent_cursors():
    index = frozen_index([1, 2, 3, 4, 1, 2, 5])
    a, b = ReferenceCursor(index), ReferenceCursor(index)
    a.advance([9, 1, 2])
    b.advance([3])
    assert (a.match_len, a.draft(3)) == (2, [5])  # most recent "1 2" is followed by 5
    assert (b.match_len, b.draft(3)) == (1, [4, 1, 2])


def test_reference_cursor_draft_is_empty_at_the_documents_end():
    cursor = ReferenceCursor(frozen_index([1, 2, 3]))
    cursor.advance([2, 3])
    assert cursor.match_len == 2 and cursor.draft(4) == []


def test_a_failed_advance_degrades_the_cursor():
    cursor = ReferenceCursor(frozen_index([1, 2, 3, 4]))
    cursor.advance([1])
    with pytest.raises(TypeError):
        cursor.advance([2, None])
    assert cursor.degraded and cursor.match_len == 0 and cursor.draft(4) == []


# ---------------------------------------------------------------- RecyclingTable


def test_recycling_table_example_and_padding():
    table = RecyclingTable(vocab_size=16, k=4)
    table.update(3, [7, 9])
    table.update(7, [5])
    assert table.draft_chain(3, 4) == [7, 5]
    assert table.table[3].tolist() == [7, 9, -1, -1]
    assert table.table.dtype == np.int32
    assert table.successors(3) == [7, 9]
    assert table.draft_chain(0, 4) == []  # never observed


def test_recycling_table_overwrites_with_newer_successors():
    table = RecyclingTable(vocab_size=16, k=3)
    table.update(3, [7, 9, 11])
    table.update(3, [8])
    assert table.table[3].tolist() == [8, -1, -1]  # old tail does not survive


def test_recycling_chain_stops_at_budget_and_cycles():
    table = RecyclingTable(vocab_size=16, k=2)
    table.update(3, [7])
    table.update(7, [3])
    assert table.draft_chain(3, 5) == [7, 3, 7, 3, 7]
    assert table.draft_chain(3, 0) == []
    table.update(1, [2])
    table.update(2, [4])
    table.update(4, [6])
    assert table.draft_chain(1, 2) == [2, 4]


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 9), st.lists(st.integers(-1, 9), min_size=4, max_size=4)),
        max_size=30,
    ),
    width=st.integers(1, 4),
)
def test_update_many_equals_repeated_update(rows, width):
    one, many = RecyclingTable(10, k=4), RecyclingTable(10, k=4)
    for token, successors in rows:
        one.update(token, successors[:width])
    tokens = np.array([t for t, _ in rows], dtype=np.int64)
    successors = np.array([s[:width] for _, s in rows], dtype=np.int64).reshape(-1, width)
    many.update_many(tokens, successors)
    np.testing.assert_array_equal(many.table, one.table)


def test_recycling_table_rejects_out_of_range_values():
    table = RecyclingTable(vocab_size=8, k=2)
    with pytest.raises(ValueError, match="-1"):
        table.update(-1, [1])  # numpy would silently write the last row
    with pytest.raises(ValueError, match="8"):
        table.update(1, [8])
    with pytest.raises(ValueError, match="k=2"):
        table.update(1, [1, 2, 3])
    with pytest.raises(ValueError):
        table.update_many(np.array([1, 9]), np.array([[1], [2]]))
    assert (table.table == -1).all()
