"""Places in a queue: taken when a request is admitted, before it is prepared, and given
back when its requests are handed over (or dropped). The engine thread and the replica
front both bound their queues this way: in all (``max_queue``) and per tenant (its
``max_queued``, counting its places and its requests already queued past them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.config import TenantLimits
from ember.engine.admission import TenantQueueFull
from ember.engine.output import RequestOutput

OutputCallback = Callable[[RequestOutput], None]


class QueuePlaces:
    """The places taken (``count``), and those of each tenant with a ``max_queued`` limit.
    Not locked: the owner's lock guards it with the rest of its queue state."""

    def __init__(self, limits_for: Callable[[str | None], TenantLimits]) -> None:
        self.limits_for = limits_for
        self.count = 0
        self._per_tenant: dict[str, int] = {}

    def take(self, tenant: str | None, waiting: Callable[[str], int]) -> str | None:
        """One place for ``tenant``, refused (``TenantQueueFull``, naming only its own
        limit) when its places plus ``waiting(tenant)`` (its requests queued past them)
        reach its ``max_queued``. Returns the key the place counts under (None: the
        tenant has no limit, nothing to count)."""
        limit = self.limits_for(tenant).max_queued
        key = None
        if limit is not None:
            key = tenant or ""
            queued = self._per_tenant.get(key, 0) + waiting(key)
            if queued >= limit:
                raise TenantQueueFull(f"tenant {key!r} has {queued} requests queued, its "
                                      f"limit (max_queued={limit})")
            self._per_tenant[key] = self._per_tenant.get(key, 0) + 1
        self.count += 1
        return key

    def per_tenant(self) -> dict[str, int]:
        """Places taken per tenant with a limit (a copy)."""
        return dict(self._per_tenant)

    def give_back(self, key: str | None) -> None:
        self.count -= 1
        if key is not None:
            self._per_tenant[key] -= 1


class Slot:
    """A place in a queue, held from admission until the requests are handed over (or
    released). Use as a context manager: leaving without submitting releases."""

    def __init__(self, hand_over: Callable[[list[Any], OutputCallback, str | None], list[str]],
                 give_back: Callable[[str | None], None], key: str | None) -> None:
        self._hand_over, self._give_back, self._key = hand_over, give_back, key
        self._open = True

    @property
    def open(self) -> bool:
        """Not yet submitted nor released."""
        return self._open

    def submit(self, group: list[Any], callback: OutputCallback) -> list[str]:
        """Hand prepared requests (one group: n choices of a prompt) over; returns their
        ids at once. ``callback`` receives every output of every request."""
        if not self._open:
            raise RuntimeError("slot already used")
        self._open = False
        return self._hand_over(group, callback, self._key)

    def release(self) -> None:
        if self._open:
            self._open = False
            self._give_back(self._key)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
