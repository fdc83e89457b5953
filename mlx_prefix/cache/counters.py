"""The prompt cache's counters (hits, misses, tokens reused, evictions) and the
CacheStats snapshot built from them and the stored entries.

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlx_prefix.cache.entries import EntryTable
from mlx_prefix.cache.eviction.budget import Budget
from mlx_prefix.cache.types import CacheStats, CheckpointKind


@dataclass(slots=True)
class Counters:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0
    handed_over: int = 0  # entries given to the request extending them (`Contents.hand_over`)
    peak_bytes: int = 0  # most stored + running bytes after any change (`Contents.evict`)

    def stats(self, table: EntryTable, budget: Budget) -> CacheStats:
        """The counters with what is stored and running now. Does not mutate."""
        entries = table.by_id.values()
        counts = dict.fromkeys((k.name for k in CheckpointKind), 0)
        for e in entries:
            counts[e.kind.name] += 1
        return CacheStats(
            **asdict(self),  # every counter, under its own name
            entries=len(table.by_id),
            bytes=table.resident.total,
            bytes_by_kind=table.bytes_by_kind(),
            entries_by_kind=counts,
            active_bytes=budget.active_bytes(),
            active_requests=len(budget.active),
            budget_bytes=budget.nbytes,
            pinned=sum(1 for e in entries if e.pinned),
            locked=sum(1 for e in entries if e.refs > 0),
        )
