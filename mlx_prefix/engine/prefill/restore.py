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
    # A prefetch that fits neither beside its entry nor in its place: not started
    # (nothing restored, nothing locked).
    no_room: bool = False

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
    speculative: bool = False,
) -> Restored:
    """Match `tokens` in memory, then on `disk` (None: not for this request) when it
    gives more; a disk hit goes into memory too. The caller releases `lease` when the
    request no longer holds the arrays. The restored KV layers have room for the first
    grid chunk after the restored position (its append then writes in place).
    `hand_over`: the request may take the entry it restores (KV layers, and a hybrid
    model's fixed-size ones) when the budget cannot hold it beside the request's own
    copy (`PromptCache.hand_over`). `speculative`: a next-turn prefetch, which stores its
    end from its cache (engine/prefill/cancelled.py `keep_left`): handed the entry only
    where that end fits in its place, and `no_room` (nothing restored) where neither
    fits: a speculative prefill never takes the budget past its cap, nor loses the
    entry the next turn restores."""
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
        needed: list[int] = []  # what a copy beside the entry would take
        # Only an entry the request extends whole: one it leaves at a trim point is
        # another conversation's (or this one's other branch), kept as it is.
        if match.entry_id is not None and hand_over and not match.trim:
            computed = len(tokens) - match.reuse_tokens

            def need(payload: object) -> int | None:
                """What the request holds besides the entry, sharing it: a live copy of
                the whole prompt, its buffers as they grow on the step grid (`_kv_room`,
                what `handover.kv_growth` bounds on a live cache: not a whole step more),
                and its end's piece; a hybrid one's other layers twice (live, and
                captured at its end)."""
                if (size := _size(payload)) is None:
                    return None
                at_end = size.at_end(grid, tokens, match.reuse_tokens)
                needed.append(at_end + size.piece(computed))
                return needed[-1]

            def keeps(payload: object) -> int:
                """Its cache at its end, stored in the entry's place (views, no piece)."""
                size = _size(payload)
                return 0 if size is None else size.at_end(grid, tokens, match.reuse_tokens)

            handed = store.hand_over(match.entry_id, need, keeps if speculative else None)
            if handed is None and speculative and needed and not store.has_room(needed[-1]):
                found.no_room = True
                return found
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


@dataclass(frozen=True, slots=True)
class _Size:
    exact: float  # KV bytes per position of the cache itself
    state: int  # a hybrid's other layers

    def piece(self, positions: int) -> int:
        """A checkpoint's piece of `positions` KV positions (a copy of exactly those)."""
        return int(self.exact * positions)

    def at_end(self, grid: ChunkGrid, tokens: Sequence[int], reuse: int) -> int:
        """The cache restored at `reuse` (room for its first chunk, up to the next whole
        step: layers/kv.py `room`) and grown by mlx-lm's steps through the grid's chunks
        to the end of `tokens`, its other layers twice."""
        return self.piece(_kv_room(grid, tokens, reuse)) + 2 * self.state


def _kv_room(grid: ChunkGrid, tokens: Sequence[int], reuse: int, step: int = KVCache.step) -> int:
    """Positions a KV layer restored at `reuse` holds once its prefill has appended the
    grid's chunks to the end of `tokens`: its restored room ends on the step grid past the
    first chunk (layers/kv.py `room`); an append past the buffer grows it by whole steps
    from its offset (mlx-lm's `KVCache.update_and_fetch`)."""
    ends = grid.chunk_ends(tokens, reuse)
    room = -(-ends[0] // step) * step
    position = ends[0]
    for end in ends[1:]:
        if end > room:
            room = position + -(-(end - position) // step) * step
        position = end
    return room


def _size(payload: object) -> _Size | None:
    """What a live cache restored from `payload` takes per position, and besides (None:
    it is never handed over: `plain_kv`)."""
    if not isinstance(payload, Snapshot) or not plain_kv(payload) or not payload.length:
        return None
    kv = payload.chain.nbytes
    piece = payload.chain.pieces[0]
    exact = sum(a.nbytes for p in piece.parts for a in p) / (piece.end - piece.start)
    return _Size(exact, payload.nbytes - kv)
