"""What callers (the server's cache routes and dashboard, any thread) read of the engine's
cache and the single-entry actions they take: statistics, listings with token ids,
flush, pin/unpin and evict one entry, and the engine's published activity. Every call
goes to the thread-safe store and disk tier, never to the engine thread's records
(invariant 1). An action is a CacheAction, applied where the engine's turn driver says
(engine/driver.py: at once; a sharded group: on every rank at the same turn): the
Engine hands its driver's `act` and `describe` in; without them (an unloaded model's
views, server/served/unloaded.py) an action is applied at once and no more is described.
The server reads an engine's views as `engine.views` (engine/interface.py CacheViewsAPI)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mlx_prefix.cache.disk.index import DiskEntryInfo
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.types import EntryInfo, EvictOutcome, StoredTokens
from mlx_prefix.engine.activity import Activity, ActivityBoard
from mlx_prefix.engine.decode.speculative import Speculator
from mlx_prefix.engine.keys import namespace_key
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.requests.jobs import PrefetchStats


@dataclass(frozen=True, slots=True)
class CacheAction:
    """A caller's change to the cache (a sharded group does it on every rank at the
    same point: engine/sharded/plan.py carries it)."""

    name: str  # "flush" | "pin" | "unpin" | "evict"
    entry_id: int = -1
    namespace: str | None = None  # flush: of one namespace (None: all)


class CacheViews:
    def __init__(
        self,
        store: PromptCache,
        disk: DiskAccess | None,
        model_key: str,
        prefetch: PrefetchStats,
        board: ActivityBoard,
        speculator: Speculator | None = None,
        *,
        act: Callable[[CacheAction, CacheViews], Any] | None = None,
        describe: Callable[[], dict[str, Any]] | None = None,
    ):
        self.store = store
        self.disk = disk
        self.model_key = model_key
        self.prefetch = prefetch  # counted by the engine thread, read here
        self.board = board
        self.speculator = speculator
        self._act = act  # the turn driver's (engine/driver.py Turns.act); None: at once
        self._describe = describe  # what the turn driver adds to the stats (its ranks)

    def cache_stats(self) -> dict:
        """The store's (and disk tier's, draft model's) counters, and the turn driver's."""
        extra = self._describe() if self._describe is not None else {}
        return {**self._stats(), **extra}

    def _stats(self) -> dict:
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
        if self.speculator is not None:  # --draft-model
            spec = self.speculator.stats
            stats["speculative"] = {**asdict(spec), "acceptance": spec.acceptance}
        return stats

    def cache_entries(self) -> list[dict]:
        return [asdict(e) for e in self.store.entries()]

    def activity(self) -> Activity:
        """Requests waiting, prefilling and decoding, as of the engine's last turn."""
        return self.board.current

    def cache_sequences(self) -> list[StoredTokens[EntryInfo]]:
        """This model's entries in memory (every namespace: `info.model_key` names each
        one's), with their token ids. Does not mutate."""
        return self.store.sequences(self.model_key)

    def disk_sequences(self) -> list[StoredTokens[DiskEntryInfo]]:
        """This model's checkpoint files, with their token ids. Does not mutate."""
        return self.disk.cache.sequences(self.model_key) if self.disk is not None else []

    # -- the actions (any thread), where the turn driver says ---------------------------
    def flush_cache(self, namespace: str | None = None) -> int:
        """Drop this model's entries (of one namespace, every salt in it; None: of all)
        from memory and disk; returns how many."""
        return self._take(CacheAction("flush", namespace=namespace))

    def set_pinned(self, entry_id: int, pinned: bool) -> bool:
        """Pin or unpin one of this model's entries; False if there is no such entry."""
        return self._take(CacheAction("pin" if pinned else "unpin", entry_id))

    def evict_entry(self, entry_id: int) -> EvictOutcome:
        """Drop one of this model's entries from memory (a disk copy stays)."""
        return self._take(CacheAction("evict", entry_id))

    def _take(self, action: CacheAction) -> Any:
        return self._act(action, self) if self._act is not None else self.apply(action)

    def apply(self, action: CacheAction) -> Any:
        """Do a caller's action here and now (the turn driver's part); its result
        (mutates the store, and the disk for a flush)."""
        if action.name == "flush":
            return self._flush(action.namespace)
        if action.name in ("pin", "unpin"):
            return self.store.set_pinned(self.model_key, action.entry_id, action.name == "pin")
        if action.name == "evict":
            return self.store.evict_entry(self.model_key, action.entry_id)
        raise ValueError(f"unknown cache action {action.name!r}")

    def _flush(self, namespace: str | None) -> int:
        key = self.model_key if namespace is None else namespace_key(self.model_key, namespace)
        removed = self.store.clear(key)
        if self.disk is not None:
            removed += self.disk.cache.clear(key)
        return removed
