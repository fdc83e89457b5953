"""What callers (the server's cache routes and dashboard, any thread) read of the engine's
cache and the single-entry actions they take: statistics, listings with token ids,
flush, pin/unpin and evict one entry, and the engine's published activity. Every call
goes to the thread-safe store and disk tier, never to the engine thread's records
(invariant 1); the Engine inherits them (a sharded engine overrides the actions, which it
must agree on across ranks)."""

from __future__ import annotations

from dataclasses import asdict

from mlx_prefix.cache.disk_index import DiskEntryInfo
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.types import EntryInfo, EvictOutcome, StoredTokens
from mlx_prefix.engine.activity import Activity, ActivityBoard
from mlx_prefix.engine.keys import namespace_key
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.requests.jobs import PrefetchStats


class CacheViews:
    store: PromptCache
    disk: DiskAccess | None
    model_key: str
    prefetch: PrefetchStats
    _board: ActivityBoard

    def cache_stats(self) -> dict:
        stats = asdict(self.store.stats())
        lookups = stats["hits"] + stats["misses"]
        stats["hit_ratio"] = stats["hits"] / lookups if lookups else 0.0
        stats["prefetch"] = asdict(self.prefetch)
        if self.disk is not None:
            disk = asdict(self.disk.cache.stats())
            disk["directory"] = str(disk["directory"])
            disk["pending_saves"] = self.disk.pending
            disk["dropped_saves"] = self.disk.dropped  # each logged when dropped
            stats["disk"] = disk
        if (spec := getattr(self, "speculation", None)) is not None:  # --draft-model
            stats["speculative"] = {**asdict(spec), "acceptance": spec.acceptance}
        return stats

    def cache_entries(self) -> list[dict]:
        return [asdict(e) for e in self.store.entries()]

    def flush_cache(self, namespace: str | None = None) -> int:
        """Drop this model's entries (of one namespace, every salt in it; None: of all)
        from memory and disk; returns how many."""
        key = self.model_key if namespace is None else namespace_key(self.model_key, namespace)
        removed = self.store.clear(key)
        if self.disk is not None:
            removed += self.disk.cache.clear(key)
        return removed

    # -- the dashboard: read-only views (any thread) and single-entry actions ---------
    def activity(self) -> Activity:
        """Requests waiting, prefilling and decoding, as of the engine's last turn."""
        return self._board.current

    def cache_sequences(self) -> list[StoredTokens[EntryInfo]]:
        """This model's entries in memory (every namespace: `info.model_key` names each
        one's), with their token ids. Does not mutate."""
        return self.store.sequences(self.model_key)

    def disk_sequences(self) -> list[StoredTokens[DiskEntryInfo]]:
        """This model's checkpoint files, with their token ids. Does not mutate."""
        return self.disk.cache.sequences(self.model_key) if self.disk is not None else []

    def set_pinned(self, entry_id: int, pinned: bool) -> bool:
        """Pin or unpin one of this model's entries; False if there is no such entry."""
        return self.store.set_pinned(self.model_key, entry_id, pinned)

    def evict_entry(self, entry_id: int) -> EvictOutcome:
        """Drop one of this model's entries from memory (a disk copy stays)."""
        return self.store.evict_entry(self.model_key, entry_id)
