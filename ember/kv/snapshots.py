"""Snapshots of a hybrid model's recurrent state at block boundaries, for the prefix cache.

A recurrent layer's state is the whole memory of a sequence's prefix: unlike K/V it
cannot be rebuilt from cached blocks. So while a sequence runs, its state after the
token that ends a block is copied to a snapshot slot (the model writes it during the
step, see ``ember/kernels/delta_net.h``), and once that block is in the prefix cache
the snapshot is filed under the block's chain key and its identity serial. A later
request whose cached prefix reaches that block restores the snapshot into its own state
slot and computes only the rest: on the native stack, whose scan is the same arithmetic
however a sequence is split into steps, the same bits as computing it all.

A snapshot is served only for the very block it was taken after: the lookup gives the
serial of the cached block found at that position, and a snapshot filed under another
serial (another computation of the same key, or a hash collision) is not used. Slots
are a fixed budget, least recently used first out; a slot promised to a waiting
request (``pin``) is never taken until it is restored. A request keeps at most its
prompt's snapshot and its newest one from decoding: each new decode snapshot drops the
request's previous one, so a long answer does not fill the budget with its own past.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Filed:
    slot: int
    serial: int  # the prefix cache's identity of the block the state follows
    salt: bytes  # the prefix-cache scope (tenant) it was computed under
    pins: int = 0


class StateSnapshots:
    """``capacity`` snapshot slots: free, pending (written by this step's forward, not
    yet filed) or filed under a block's chain key."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._filed: OrderedDict[bytes, _Filed] = OrderedDict()  # LRU first
        self.version = 0  # bumped when a filed snapshot goes (lookups must be redone)

    def __len__(self) -> int:
        return len(self._filed)

    def find(self, key: bytes, serial: int) -> int | None:
        """The slot filed for the block with this chain key and serial (None: none)."""
        filed = self._filed.get(key)
        if filed is None or filed.serial != serial:
            return None
        self._filed.move_to_end(key)
        return filed.slot

    def take(self) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used filed one
        not pinned; None when every slot is pinned or pending."""
        if self._free:
            return self._free.pop()
        for key, filed in self._filed.items():
            if not filed.pins:
                del self._filed[key]
                self.version += 1
                return filed.slot
        return None

    def file(self, key: bytes, serial: int, slot: int, salt: bytes = b"") -> bool:
        """File a pending slot under a block (replacing what was filed under its key);
        False where the key's snapshot is promised to a waiting request: that one stays,
        the new slot goes back."""
        old = self._filed.pop(key, None)
        if old is not None:
            if old.pins:
                self._filed[key] = old
                self._free.append(slot)
                return False
            self._free.append(old.slot)
            self.version += 1
        self._filed[key] = _Filed(slot, serial, salt)
        return True

    def release(self, slot: int) -> None:
        """Give back a pending slot (its step failed, or its block was not cached)."""
        self._free.append(slot)

    def drop(self, key: bytes, slot: int | None = None) -> None:
        """Forget what is filed under ``key`` (only if in ``slot``, where given) unless it
        is pinned."""
        filed = self._filed.get(key)
        if filed is not None and not filed.pins and slot in (None, filed.slot):
            del self._filed[key]
            self._free.append(filed.slot)
            self.version += 1

    def purge(self, match: Callable[[bytes], bool]) -> int:
        """Forget every unpinned snapshot whose salt ``match`` accepts (a tenant's, as the
        prefix cache's purge); returns how many."""
        keys = [k for k, f in self._filed.items() if match(f.salt) and not f.pins]
        for key in keys:
            self.drop(key)
        return len(keys)

    def pin(self, key: bytes) -> int:
        filed = self._filed[key]
        filed.pins += 1
        return filed.slot

    def unpin(self, key: bytes) -> int:
        filed = self._filed[key]
        filed.pins -= 1
        return filed.slot

    def check(self) -> None:
        """Every slot is free or filed, none pinned (no requests alive)."""
        pinned = [k for k, f in self._filed.items() if f.pins]
        if pinned or len(self._free) + len(self._filed) != self.capacity:
            raise AssertionError(f"state snapshots leaked: {len(self._free)} free, "
                                 f"{len(self._filed)} filed ({len(pinned)} pinned) of "
                                 f"{self.capacity}")
