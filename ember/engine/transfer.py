"""KV leaving and entering the engine: prefix export/import and the disk tier.

Records are the disk tier's checksummed block format (:class:`~ember.kv.disk.BlockRecord`);
whatever imports them verifies each against the tenant's salt and the chain keys
before it is used, so a record from another model, tenant or layout is never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ember.config import EngineConfig
from ember.engine.costs import StepShape
from ember.kv.blocks import KVStorage
from ember.kv.disk import BlockRecord, DiskStore
from ember.kv.disk import fingerprint as disk_fingerprint
from ember.kv.manager import KVCacheManager
from ember.kv.prefix import extend_keys, tenant_name, tenant_of
from ember.kv.tier import (
    DiskTier,
    HandedStates,
    SnapshotBytes,
    blocks_of,
    restore_chain,
    state_record,
)
from ember.models.config import ModelConfig


class KVTransfer:
    def __init__(self, config: EngineConfig, model: ModelConfig, model_fingerprint: str,
                 kv: KVCacheManager, storage: KVStorage,
                 salt_for: Callable[[str | None, Any], bytes]) -> None:
        self.config = config
        self.model = model
        self.model_fingerprint = model_fingerprint
        self.kv = kv
        self.storage = storage
        self.salt_for = salt_for
        self.disk: DiskStore | None = None

    def fingerprint(self) -> bytes:
        """What stored KV bytes depend on besides their tokens and salt: the weights
        (file hash and format), the KV dtype, the block size and the geometry."""
        c, m = self.config, self.model
        return disk_fingerprint(self.model_fingerprint, f"kv:{c.kv_dtype}",
                                f"block:{c.block_size}", f"layers:{m.n_layers}",
                                f"kv_heads:{m.n_kv_heads}", f"head_dim:{m.head_dim}",
                                "layout:block,layer,kv,pos,head,dim")

    def export_prefix(self, tokens: Sequence[int], tenant: str | None = None,
                      lora: Any = None) -> list[BlockRecord]:
        """The cached full blocks of ``tokens`` (the longest cached prefix) for
        ``tenant`` and LoRA adapter ``lora`` (None: the base), as records. A hybrid
        model's chain ends at the last block whose recurrent state has a snapshot (in
        RAM or on the disk tier), and that snapshot follows it as one more record
        (:func:`~ember.kv.tier.is_state`)."""
        prefix = self.kv.prefix
        if prefix is None:
            return []
        salt = self.salt_for(tenant, lora)
        keys: list[bytes] = []
        extend_keys(keys, salt, tokens, self.config.block_size)
        found = self.kv.usable(keys, prefix.lookup(salt, tokens, keys), salt, tokens,
                               self.kv.tier)
        records = [BlockRecord(*prefix.identity(hit.block), self.storage.block_bytes(hit.block))
                   for hit in found]
        if self.kv.snapshots is not None and found:
            n, bs = len(found), self.config.block_size
            slot = self.kv.snapshots.find(keys[n - 1], found[-1].serial)
            assert slot is not None  # usable() ends the chain where one is filed
            storage: SnapshotBytes = self.storage  # type: ignore[assignment]
            records.append(state_record(keys[n - 1], salt, tokens[(n - 1) * bs:n * bs],
                                        storage.snapshot_bytes(slot)))
        return records

    def cached_tokens(self, tokens: Sequence[int], tenant: str | None = None,
                      lora: Any = None) -> int:
        """How many of ``tokens`` (from the first) the prefix cache holds for ``tenant``
        and ``lora`` now, in whole blocks."""
        prefix = self.kv.prefix
        if prefix is None:
            return 0
        salt = self.salt_for(tenant, lora)
        keys: list[bytes] = []
        extend_keys(keys, salt, tokens, self.config.block_size)
        found = self.kv.usable(keys, prefix.lookup(salt, tokens, keys))
        return len(found) * self.config.block_size

    def import_prefix(self, records: Sequence[BlockRecord], tenant: str | None = None,
                      lora: Any = None, prompt: Sequence[int] = (), first: int = 0) -> int:
        """Cache ``records`` (a chain from the first block, as :meth:`export_prefix` gives,
        or from block ``first`` when the cache holds the blocks of ``prompt`` before it)
        for ``tenant`` and ``lora``; returns how many tokens of the chain the cache now
        holds from its start — for a hybrid model, as far as a snapshot among the records
        (or one cached here) reaches. Records that do not verify for them (salt, chain
        keys, parents) end the import: blocks computed with another adapter (or none)
        are never taken."""
        prefix = self.kv.prefix
        chain = blocks_of(records)
        if prefix is None or not (chain or first):
            return 0
        bs = self.config.block_size
        salt = self.salt_for(tenant, lora)
        tokens = [*prompt[:first * bs], *(t for rec in chain for t in rec.tokens)]
        keys: list[bytes] = []
        extend_keys(keys, salt, tokens, bs)
        found = prefix.lookup(salt, tokens, keys)
        if len(found) >= first:  # else a block before the records is gone: recompute
            restore_chain(prefix, self.storage, salt, tokens, keys, found,
                          lambda i: chain[i - first], len(keys), stored=False)
        states = HandedStates(records, self.storage)  # type: ignore[arg-type]
        return len(self.kv.usable(keys, found, salt, tokens, states)) * bs

    def purge(self, match: Callable[[bytes], bool]) -> dict[str, int]:
        """Forget the cached prefixes (every adapter's) whose salt ``match`` accepts (a
        tenant's) in RAM, and a hybrid's snapshots of them; blocks running requests hold
        are freed when they finish. Conversation files are the user's: untouched. Engine
        thread only; the disk part may run anywhere (:meth:`purge_disk`)."""
        ram = self.kv.prefix.purge(match) if self.kv.prefix else 0
        if self.kv.snapshots is not None:
            self.kv.snapshots.purge(match)
        if self.kv.tier is not None:
            self.kv.tier.forget_reads()  # nothing read before the purge may be restored
        return {"ram_blocks": ram}

    def purge_disk(self, match: Callable[[bytes], bool]) -> dict[str, int]:
        """Delete those prefixes' blocks (and snapshots) from the disk tier (thread-safe;
        after :meth:`purge`, so that RAM spills none of them again)."""
        if self.disk is None:
            return {"disk_blocks": 0, "disk_bytes": 0}
        blocks, nbytes = self.disk.purge(match)
        return {"disk_blocks": blocks, "disk_bytes": nbytes}

    def attach_disk_tier(self, predict: Callable[[StepShape], float]) -> None:
        """Back the prefix cache with a block store under ``config.kv_cache_dir``; the
        tier restores a block when reading it beats recomputing (``predict`` prices
        the recompute)."""
        c = self.config
        assert c.kv_cache_dir is not None
        self.disk = DiskStore(
            c.kv_cache_dir, self.fingerprint(), c.kv_disk_bytes, c.kv_fsync,
            scope_of=tenant_of,
            cap=lambda scope: c.limits_for(tenant_name(scope)).share("disk_share",
                                                                     c.kv_disk_bytes))

        def recompute_seconds(tokens: int, end: int) -> float:
            return predict(StepShape(tokens, 1, tokens * end))

        self.kv.attach_tier(DiskTier(self.disk, self.storage, recompute_seconds, c.kv_restore))

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def metrics(self) -> dict[str, Any] | None:
        """The disk tier's counters, decisions and size; None without a disk tier."""
        tier = self.kv.tier
        if self.disk is None or tier is None:
            return None
        return {**dataclasses.asdict(self.disk.stats), "blocks": len(self.disk),
                "bytes": self.disk.size_bytes, "decisions": dict(tier.decisions),
                "restored_blocks": tier.restored_blocks,
                "restored_snapshots": tier.restored_snapshots,
                "read_bytes_per_second": tier.read_bps}
