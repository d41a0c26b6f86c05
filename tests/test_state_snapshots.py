"""The recurrent-state snapshots' slots (ember.kv.snapshots): least recently used out,
never one promised to a waiting request, served only for the block they follow."""

from __future__ import annotations

import pytest

from ember.kv.snapshots import StateSnapshots


def test_slots_are_reused_least_recently_used_first_but_never_pinned() -> None:
    snaps = StateSnapshots(2)
    a, b = snaps.take(), snaps.take()
    snaps.file(b"A", 1, a)
    snaps.file(b"B", 2, b)
    assert snaps.find(b"A", 1) == a  # A is now the most recently used
    assert snaps.take() == b and snaps.find(b"B", 2) is None  # B went
    snaps.release(b)
    assert snaps.pin(b"A") == a
    c = snaps.take()
    assert c == b and snaps.take() is None  # A is pinned: nothing left to take
    snaps.release(c)
    assert snaps.unpin(b"A") == a
    snaps.check()


def test_a_snapshot_is_served_only_for_the_block_serial_it_follows() -> None:
    snaps = StateSnapshots(2)
    slot = snaps.take()
    snaps.file(b"K", 7, slot)
    assert snaps.find(b"K", 8) is None and snaps.find(b"K", 7) == slot
    # filed again under the same key (another computation of the block): replaced
    other = snaps.take()
    snaps.file(b"K", 9, other)
    assert snaps.find(b"K", 7) is None and snaps.find(b"K", 9) == other
    snaps.check()
    # but a pinned one stays, and the new slot goes back
    snaps.pin(b"K")
    third = snaps.take()
    assert not snaps.file(b"K", 10, third)
    assert snaps.find(b"K", 9) == other
    with pytest.raises(AssertionError, match="pinned"):
        snaps.check()
    snaps.unpin(b"K")
    snaps.drop(b"K", slot=slot)  # filed in another slot by now: kept
    assert snaps.find(b"K", 9) == other
    snaps.drop(b"K", slot=other)
    assert len(snaps) == 0
    snaps.check()


def test_a_tenant_purge_forgets_its_snapshots_but_not_a_pinned_one() -> None:
    snaps = StateSnapshots(3)
    for key, salt in ((b"a1", b"A"), (b"a2", b"A"), (b"b1", b"B")):
        snaps.file(key, 1, snaps.take(), salt)
    snaps.pin(b"a2")
    assert snaps.purge(lambda salt: salt == b"A") == 1
    assert snaps.find(b"a1", 1) is None
    assert snaps.find(b"a2", 1) is not None and snaps.find(b"b1", 1) is not None
    snaps.unpin(b"a2")
    snaps.check()


def test_a_step_refuses_a_snapshot_slot_two_rows_would_write() -> None:
    """Each token that asks for a snapshot names its slot; two rows naming one slot in
    a step would race (the native stack writes rows in parallel): refused, as is an
    index past the row."""
    import torch

    from ember.models.layers.attention import AttentionBatch, RowSpec

    def batch(*snapshots: tuple[int, int] | None) -> AttentionBatch:
        return AttentionBatch.build([RowSpec(torch.tensor([i]), 0, 3, state=i, snapshot=s)
                                     for i, s in enumerate(snapshots)], 16)

    assert batch((2, 5), None, (0, 6)).token_snapshots().tolist() == [
        -1, -1, 5, -1, -1, -1, 6, -1, -1]
    with pytest.raises(ValueError, match="slot 5 asked for by two rows"):
        batch((2, 5), (0, 5)).token_snapshots()
    with pytest.raises(ValueError, match="after query token 3 of a row of 3"):
        batch((3, 1)).token_snapshots()
