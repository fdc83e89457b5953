"""The prompt cache's limits: what counts against its byte budget, whether a new entry
fits, and which entry eviction takes next.

Stored bytes (distinct buffers: one prefill's checkpoints share their KV) + running
requests' bytes (less the buffers they share with stored entries: `active.py`) <= the
budget, and at most `max_entries` entries when set, unless every remaining entry is
pinned or locked (invariant 6). The eviction policy orders the others.

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from mlx_prefix.cache.entries import Entry, EntryTable
from mlx_prefix.cache.eviction.active import ActiveBytes
from mlx_prefix.cache.eviction.policy import Candidate, EvictionPolicy
from mlx_prefix.cache.types import Buffer


class Budget:
    def __init__(
        self,
        nbytes: int,
        max_entries: int | None,
        table: EntryTable,
        policy: EvictionPolicy[Entry],
    ) -> None:
        self.nbytes = nbytes
        self.max_entries = max_entries
        self.active = ActiveBytes()  # running requests' bytes
        self._table = table
        self._policy = policy
        policy.bind(lambda: self.nbytes)  # read when ranking: set_budget may change it

    def active_bytes(self) -> int:
        return self.active.total(self._table.resident.holds)

    def used(self) -> int:
        """Stored and active bytes, each buffer counted once."""
        return self._table.resident.total + self.active_bytes()

    def over(self) -> bool:
        if self.used() > self.nbytes:
            return True
        return self.max_entries is not None and len(self._table.by_id) > self.max_entries

    def fixed(self) -> int:
        """What eviction cannot free: running requests' bytes and the pinned or locked
        entries', each buffer once."""
        kept = [e.buffers for e in self._table.by_id.values() if e.refs > 0 or e.pinned]
        return self._table.resident.union([*kept, self.active.shared()]) + self.active.own_total

    def shortfall(self, new: Candidate, buffers: tuple[Buffer, ...], leaving: list[Entry]) -> int:
        """Bytes the budget lacks for `new`, holding `buffers`, to survive eviction once the
        `leaving` entries are gone (0: it fits; 1: only the entry count is over): what
        stays is what the policy evicts after it, plus the pinned and locked entries
        (buffers they share with it, or with running requests, count once)."""
        gone = {e.entry_id for e in leaving}
        outlasting = self._policy.outlasting(new)
        kept = [
            e
            for e in self._table.by_id.values()
            if e.entry_id not in gone and (e.refs > 0 or e.pinned or e.entry_id in outlasting)
        ]
        groups = [buffers, *(e.buffers for e in kept), self.active.shared()]
        kept_bytes = self._table.resident.union(groups)
        if (over := kept_bytes + self.active.own_total - self.nbytes) > 0:
            return over
        return 0 if self.max_entries is None or len(kept) + 1 <= self.max_entries else 1

    def victim(self) -> Entry | None:
        """The entry eviction takes next: the first in the policy's order neither locked
        nor pinned; None if every entry is."""
        return next((e for e in self._policy.order() if e.refs == 0 and not e.pinned), None)
