"""A hybrid model's recurrent state around each step: the engine's part of it.

A hybrid (Qwen 3.5) keeps one recurrent state per running sequence beside its K/V
blocks. Here: how many state slots and snapshot slots an engine allocates
(:class:`StateLayout`), and per step (:class:`RecurrentSteps`) which rows restore a
cached prefix's snapshot before they run, which take a snapshot at a block boundary
(the prefix cache's, ``ember/kv/snapshots.py``), and which verify rows keep their state
after their history so that a draft not all accepted can go back to it (the commit then
caches only the history; the accepted drafts run again next step).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ember.config import EngineConfig, InvalidConfig
from ember.engine.runner import ScheduledRow
from ember.kv.manager import KVCacheManager
from ember.models.config import ModelConfig

log = logging.getLogger("ember.engine")


def for_recurrent(config: EngineConfig, state_bytes: int) -> EngineConfig:
    """A hybrid model's engine settings: cached prefixes are served from recurrent-state
    snapshots (no room for one in RAM: no prefix reuse)."""
    if config.state_snapshot_bytes < state_bytes and config.enable_prefix_caching:
        if config.kv_cache_dir is not None:
            raise InvalidConfig("kv_cache_dir: a model with recurrent layers reuses a "
                                "prefix only through a state snapshot, and "
                                "state_snapshot_bytes has no room for one")
        log.info("recurrent layers: enable_prefix_caching=False (state_snapshot_bytes has "
                 "no room for one snapshot of a sequence's state)")
        return dataclasses.replace(config, enable_prefix_caching=False)
    return config


@dataclass(frozen=True)
class StateLayout:
    """State slots (one per sequence that may run), the prefix cache's snapshot slots,
    and, while speculation is on, one more snapshot slot per state slot (after the
    prefix cache's) where a verify row keeps its state after its history."""

    slots: int = 0
    snapshots: int = 0
    rewinds: bool = False

    @classmethod
    def of(cls, config: EngineConfig, model: ModelConfig) -> StateLayout:
        if not model.recurrent:
            return cls()
        snapshots = (config.state_snapshot_bytes // model.state_bytes_per_sequence
                     if config.enable_prefix_caching else 0)
        return cls(config.max_num_seqs, snapshots, config.speculation != "off")

    @property
    def snapshot_slots(self) -> int:
        """Every snapshot slot the storage holds."""
        return self.snapshots + (self.slots if self.rewinds else 0)

    def rewind_slot(self, state_slot: int) -> int:
        return self.snapshots + state_slot

    def describe(self, states: Any) -> str:
        return (f"recurrent state: {self.slots} sequences, {states.nbytes / 2**20:.1f} MiB, "
                f"and {self.snapshots} snapshots for the prefix cache"
                f"{' and one per sequence for speculation' if self.rewinds else ''}, "
                f"{states.snapshot_nbytes / 2**20:.1f} MiB (f32, touched as used)")


class RecurrentSteps:
    """What a step's rows do with their recurrent states before and after the forward."""

    def __init__(self, layout: StateLayout, kv: KVCacheManager, states: Any) -> None:
        self.layout, self.kv, self.states = layout, kv, states

    def before(self, rows: list[ScheduledRow]) -> None:
        """A state slot admitted with a cached prefix takes its snapshot; a row crossing a
        block boundary worth keeping gets a snapshot slot; a verify row keeps its state
        after its history (the prefix cache's snapshot of it, where it takes one)."""
        for row in rows:
            req = row.request
            snapshot = self.kv.take_restore(req)
            if snapshot is not None:
                self.states.restore(snapshot, req.state_slot)
            row.snapshot = self.kv.snapshot_point(req, row.start, row.num_tokens)
            if row.draft and row.snapshot is None:
                assert self.layout.rewinds and req.state_slot is not None
                row.snapshot = (row.num_tokens - 1, self.layout.rewind_slot(req.state_slot))

    def after(self, sampled: list[tuple[ScheduledRow, torch.Tensor]]) -> None:
        """A verify row whose draft was not all accepted took rejected tokens into its
        state: its slot goes back to the snapshot after the row's history (the commit
        has cached no more than that)."""
        if not self.layout.rewinds:
            return
        for row, _ in sampled:
            req = row.request
            if row.draft and not req.is_finished and req.kv_len < row.start + row.num_query:
                assert row.snapshot is not None and row.snapshot[0] == row.num_tokens - 1
                self.states.restore(row.snapshot[1], req.state_slot)
