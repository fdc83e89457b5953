"""Where a request's prefill starts: the longest usable cached prefix of its own entry key
(its namespace: invariant 10), from memory or, when that restores more, from disk,
restored as the request's cache (invariant 2: sharing the snapshot's arrays, or a new
buffer assembled from its chain of pieces with room for the first chunk; the memory
entry locked while the request holds its pieces). Engine thread only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mlx_lm.models.cache import KVCache

from mlx_prefix.cache.chain import Chain
from mlx_prefix.cache.handover import plain_kv, settle
from mlx_prefix.cache.snapshot import Snapshot, restore
from mlx_prefix.cache.store import CheckpointKind, PromptCache
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
    source: Literal["memory", "disk", "none"] = "none"
    matched: int = 0  # longest common prefix with a stored entry (the trie walk's)
    kind: CheckpointKind | None = None  # the restored entry's (None: nothing restored)
    # The store handed the entry over (the budget could not hold it beside this
    # request's copy): the request's end stores the longer entry in its place.
    handed_over: bool = False

    @property
    def chain(self) -> Chain:
        """The pieces holding the restored positions (the request's checkpoints continue
        them: engine/prefill/checkpoints.py)."""
        if self.snapshot is None or not self.snapshot.chain.pieces:
            return Chain()
        return self.snapshot.chain.upto(self.reuse)


def restore_longest(
    store: PromptCache,
    disk: DiskAccess | None,
    key: str,
    tokens: Sequence[int],
    grid: ChunkGrid,
    *,
    hand_over: bool = False,
) -> Restored:
    """Match `tokens` in memory, then on `disk` (None: not for this request) when it
    gives more; a disk hit goes into memory too. The caller releases `lease` when the
    request no longer holds the arrays. The restored KV layers have room for the first
    grid chunk after the restored position (its append then writes in place).
    `hand_over`: the request may take the entry it restores (KV layers, and a hybrid
    model's fixed-size ones) when the budget cannot hold it beside the request's own
    copy (`PromptCache.hand_over`)."""
    found = Restored()

    def align(n: int) -> int:
        return grid.align(tokens, n)

    def first_chunk(reuse: int) -> int:
        return grid.chunk_ends(tokens, reuse)[0] - reuse if reuse < len(tokens) else 0

    try:
        match = store.match(key, tokens, align)
        found.matched = match.matched_tokens
        found.branch = align(min(match.matched_tokens, len(tokens) - 1))
        handed = None
        # Only an entry the request extends whole: one it leaves at a trim point is
        # another conversation's (or this one's other branch), kept as it is.
        if match.entry_id is not None and hand_over and not match.trim:

            def need(payload: object) -> int | None:
                """What the request holds besides the entry, sharing it: a live copy of
                the whole prompt (grown a step at a time) and its end's piece; a hybrid
                one's other layers twice (live, and captured at its end)."""
                if not plain_kv(payload) or not payload.length:  # type: ignore[attr-defined]
                    return None
                kv = payload.chain.nbytes  # type: ignore[attr-defined]
                state = payload.nbytes - kv  # type: ignore[attr-defined]
                per_token = kv / payload.length  # type: ignore[attr-defined]
                computed = len(tokens) - match.reuse_tokens
                return int(per_token * (len(tokens) + KVCache.step + computed)) + 2 * state

            handed = store.hand_over(match.entry_id, need)
        if handed is not None:
            found.source, found.handed_over = "memory", True
            found.cache = restore(handed, match.trim, first_chunk(match.reuse_tokens))
            settle(found.cache)  # the copy made, the entry's pieces go
            found.reuse, found.trim = match.reuse_tokens, match.trim
        elif match.entry_id is not None:
            snapshot = store.acquire(match.entry_id)
            if snapshot is not None:
                found.lease, found.source = match.entry_id, "memory"
                found.cache = restore(snapshot, match.trim, first_chunk(match.reuse_tokens))
                found.reuse, found.snapshot, found.trim = match.reuse_tokens, snapshot, match.trim
                found.kind = match.kind
        if disk is not None:
            on_disk = disk.lookup(key, tokens, align, better_than=found.reuse)
            if on_disk is not None:  # a memory miss (or shorter hit) served from disk
                disk_match, disk_snapshot = on_disk
                if found.lease is not None:
                    store.release(found.lease)
                    found.lease = None
                reuse = disk_match.reuse_tokens
                found.cache = restore(disk_snapshot, disk_match.trim, first_chunk(reuse))
                found.reuse, found.source, found.handed_over = reuse, "disk", False
                found.snapshot, found.trim = disk_snapshot, disk_match.trim
                found.kind = disk_match.kind
                store.insert(key, disk_match.tokens, disk_snapshot, disk_match.kind)
    except BaseException:
        if found.lease is not None:
            store.release(found.lease)
        raise
    return found
