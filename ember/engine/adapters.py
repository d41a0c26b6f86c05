"""An engine's LoRA adapters: which are loaded, which resident, and on whose account.

Serving policy over the adapter files :mod:`ember.models.lora` reads and applies: at
most ``max_loras`` resident, fair eviction between tenants, reloads checked against
the file's identity, and the lookup a request's ``lora`` parameter goes through.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember.engine.intake import InvalidRequest
from ember.models.config import ModelConfig
from ember.models.lora import (
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_RANK,
    LoRAAdapter,
    LoRAError,
    load_lora,
)

log = logging.getLogger("ember.engine")


@dataclass
class _Entry:
    path: str
    identity: bytes
    adapter: LoRAAdapter | None  # None: evicted (reloaded from ``path`` on demand)
    holder: str | None = None  # the tenant whose request last used it (None: no request)
    counts: dict[str, int] = field(default_factory=lambda: {
        "requests": 0, "tokens": 0, "loads": 0, "evictions": 0})


class LoRARegistry:
    """An engine's adapters by name: at most ``max_loras`` resident; an evicted one is
    read again from its file when a request names it, and refused if the file changed
    since it was loaded (its identity). Requests hold the adapter they run with, so
    eviction and unloading never touch a running request. Thread-safe (the server
    prepares requests on other threads).

    Residency is shared fairly: each resident adapter counts against the tenant whose
    request used it last, and the one evicted is the least recently used of the tenant
    holding the most, so a tenant cycling through many adapters evicts its own first;
    ``max_per_tenant(tenant)`` caps what one tenant keeps resident (its own least
    recently used go past it)."""

    def __init__(self, cfg: ModelConfig, max_rank: int = DEFAULT_MAX_RANK,
                 max_loras: int = DEFAULT_MAX_LORAS, dtype: str = "f32",
                 max_per_tenant: Callable[[str], int | None] = lambda tenant: None) -> None:
        self.cfg, self.max_rank, self.max_loras, self.dtype = cfg, max_rank, max_loras, dtype
        self.max_per_tenant = max_per_tenant
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @staticmethod
    def dtype_for(option: str, model: Any) -> str:
        """``--lora-dtype``: ``auto`` is bf16 where the fused native stack applies the
        adapters, f32 where PyTorch does (f32 weights)."""
        if option != "auto":
            return option
        return "bf16" if model.native is not None else "f32"

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load the adapter at ``path`` (GGUF or PEFT directory) as ``name``, checked
        against the base (:func:`ember.models.lora.load_lora`); a name already loaded is
        replaced (requests running with the old one finish with it)."""
        adapter = self._register(name, path, load_lora(path, name, self.cfg, self.max_rank,
                                                       self.dtype))
        log.info("LoRA adapter %r: %s, rank %d, %s, %.1f MiB", name, path, adapter.rank,
                 "/".join(adapter.targets), adapter.nbytes / 2**20)
        return adapter

    def ensure(self, name: str, path: str, identity: bytes) -> None:
        """Have ``name`` be the adapter at ``path`` whose identity is ``identity``,
        loading it if this registry has another (or none): how a replica serves what
        its front loaded. Refused if the file is no longer the one the front checked."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry.identity == identity and entry.path == str(path):
                return
        adapter = load_lora(path, name, self.cfg, self.max_rank, self.dtype)
        if adapter.identity != identity:
            raise LoRAError(f"LoRA adapter {name!r}: {path} changed since it was loaded "
                            "(load it again to serve the new file)")
        self._register(name, path, adapter)

    def _register(self, name: str, path: str, adapter: LoRAAdapter) -> LoRAAdapter:
        with self._lock:
            old = self._entries.pop(name, None)
            entry = _Entry(str(path), adapter.identity, adapter)
            if old is not None:  # the name's counters go on
                entry.counts = old.counts
            entry.counts["loads"] += 1
            self._entries[name] = entry
            self._evict(keep=name)
        return adapter

    def for_request(self, name: str | None, request: bool = True,
                    tenant: str | None = None) -> LoRAAdapter | None:
        """The loaded adapter named ``name`` (None: the base model) as a request's
        ``lora`` parameter names it: an unknown or unreadable one is an invalid request.
        ``request``: for a request of ``tenant`` (counted, resident on its account)."""
        if name is None:
            return None
        try:
            adapter = self.get(name, request, tenant)
        except LoRAError as e:
            raise InvalidRequest("lora", str(e), name) from None
        if adapter is None:
            raise InvalidRequest("lora", f"no LoRA adapter {name!r} is loaded", name)
        return adapter

    def name_of(self, identity: bytes) -> str | None:
        """The name the adapter with ``identity`` is registered under (None: none)."""
        with self._lock:
            return next((n for n, e in self._entries.items() if e.identity == identity),
                        None)

    def unload(self, name: str) -> None:
        """Forget adapter ``name``; requests already running with it finish with it."""
        with self._lock:
            if self._entries.pop(name, None) is None:
                raise KeyError(f"no LoRA adapter {name!r} is loaded")

    def get(self, name: str, request: bool = True,
            tenant: str | None = None) -> LoRAAdapter | None:
        """The adapter (reloaded if evicted), for a new request of ``tenant`` unless
        ``request`` is False (then it is neither counted nor charged); None if unknown."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            self._entries.move_to_end(name)
            adapter = entry.adapter
        if adapter is None:
            adapter = load_lora(entry.path, name, self.cfg, self.max_rank, self.dtype)
            if adapter.identity != entry.identity:
                raise LoRAError(f"LoRA adapter {name!r}: {entry.path} changed since it was "
                                "loaded (load it again to serve the new file)")
            with self._lock:
                entry.adapter = adapter
                entry.counts["loads"] += 1
        with self._lock:
            if request:
                entry.counts["requests"] += 1
                entry.holder = tenant or ""
            self._evict(keep=name)
        return adapter

    def resident_by_tenant(self) -> dict[str, int]:
        """Resident adapters per tenant that last used them."""
        with self._lock:
            held: dict[str, int] = {}
            for e in self._entries.values():
                if e.adapter is not None and e.holder is not None:
                    held[e.holder] = held.get(e.holder, 0) + 1
            return held

    def count_tokens(self, adapter: LoRAAdapter, tokens: int) -> None:
        with self._lock:
            entry = self._entries.get(adapter.name)
            if entry is not None and entry.identity == adapter.identity:
                entry.counts["tokens"] += tokens

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            resident = [e.adapter for e in self._entries.values() if e.adapter is not None]
            return {"adapters": {n: dict(e.counts, resident=int(e.adapter is not None))
                                 for n, e in self._entries.items()},
                    "resident": len(resident),
                    "resident_bytes": sum(a.nbytes for a in resident)}

    def _evict(self, keep: str | None = None) -> None:
        """Evict past the limits (lock held): a tenant's own least recently used past its
        cap, then, past ``max_loras``, the least recently used of the tenant holding the
        most (``keep``: the adapter a request is taking now, never evicted)."""
        def resident(holder: object = ...) -> list[str]:
            return [n for n, e in self._entries.items() if e.adapter is not None
                    and n != keep and (holder is ... or e.holder == holder)]

        def held() -> Counter[str | None]:
            return Counter(e.holder for e in self._entries.values() if e.adapter is not None)

        for tenant, n in held().items():
            cap = None if tenant is None else self.max_per_tenant(tenant)
            for name in resident(tenant)[:max(0, n - cap)] if cap is not None else ():
                self._drop(name, f"tenant limit max_adapters={cap}")
        while len(resident()) + (keep is not None) > self.max_loras and resident():
            counts = held()
            self._drop(max(resident(), key=lambda n: counts[self._entries[n].holder]),
                       f"more than {self.max_loras} resident")

    def _drop(self, name: str, why: str) -> None:
        entry = self._entries[name]
        entry.adapter = None
        entry.counts["evictions"] += 1
        log.info("LoRA adapter %r evicted (%s)", name, why)
