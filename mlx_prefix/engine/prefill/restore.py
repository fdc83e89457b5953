"""Where a request's prefill starts: the longest usable cached prefix of its own entry key
(its namespace: invariant 10), from memory or, when that restores more, from disk,
restored as the request's cache (invariant 2: sharing the snapshot's arrays, the memory
entry locked while they may be shared). Engine thread only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlx_prefix.cache.snapshot import Snapshot, restore
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.prompt.request.grid import ChunkGrid


@dataclass(slots=True)
class Restored:
    cache: list | None = None  # None: nothing usable, prefill from a fresh cache
    reuse: int = 0  # prompt tokens restored
    lease: int | None = None  # the memory entry locked while its arrays may be shared
    # Where the prompt leaves the stored sequences: a checkpoint there serves the next
    # request of either shape (checkpoints.py).
    branch: int = 0
    snapshot: Snapshot | None = None  # what was restored (its draft part may serve too)
    trim: int = 0


def restore_longest(
    store: PromptCache,
    disk: DiskAccess | None,
    key: str,
    tokens: Sequence[int],
    grid: ChunkGrid,
) -> Restored:
    """Match `tokens` in memory, then on `disk` (None: not for this request) when it
    gives more; a disk hit goes into memory too. The caller releases `lease` when the
    request no longer shares the arrays."""
    found = Restored()

    def align(n: int) -> int:
        return grid.align(tokens, n)

    try:
        match = store.match(key, tokens, align)
        found.branch = align(min(match.matched_tokens, len(tokens) - 1))
        if match.entry_id is not None:
            snapshot = store.acquire(match.entry_id)
            if snapshot is not None:
                found.lease = match.entry_id
                found.cache = restore(snapshot, trim=match.trim)
                found.reuse, found.snapshot, found.trim = match.reuse_tokens, snapshot, match.trim
        if disk is not None:
            on_disk = disk.lookup(key, tokens, align, better_than=found.reuse)
            if on_disk is not None:  # a memory miss (or shorter hit) served from disk
                disk_match, disk_snapshot = on_disk
                if found.lease is not None:
                    store.release(found.lease)
                    found.lease = None
                found.cache = restore(disk_snapshot, trim=disk_match.trim)
                found.reuse = disk_match.reuse_tokens
                found.snapshot, found.trim = disk_snapshot, disk_match.trim
                store.insert(key, disk_match.tokens, disk_snapshot, disk_match.kind)
    except BaseException:
        if found.lease is not None:
            store.release(found.lease)
        raise
    return found
