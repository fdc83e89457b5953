"""What a cancelled prefill keeps (issue 55): the state where it stopped.

Where it stops on a grid point between two chunks (the cache holds exactly that prefix,
computed alone on the grid), `keep_reached` stores the state there; where it stops at
its end or where it was restored, with that state left to a decode row that will never
store it (cache/handover.py), `keep_handed` stores it from the cache. Those entries are
CANCELLED (the protected kinds aside): the first to go, never pushing out an entry
someone asked for. A prefill that runs on once its client has gone stores what it
reaches from then on (`Checkpointer.cancel`, checkpoints.py).

A next-turn prefetch has no decode row either: what a tight budget left to one (the
entry the store handed it, its end) is stored from its cache where it ends or gives way
(`keep_left`), in place of the entry it was handed; it never holds a second copy.
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_prefix.cache.eviction.policy import PROTECTED_ABOVE
from mlx_prefix.cache.handover import at_offset, hybrid, live_snapshot
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.engine.prefill.checkpoints import Checkpointer
from mlx_prefix.engine.prefill.task import PrefillTask
from mlx_prefix.prompt.request.grid import ChunkGrid


def keep_stopped(
    task: PrefillTask, *, cancelled: bool, grid: ChunkGrid, store: PromptCache
) -> None:
    """`task` is closed, not failed: a `cancelled` one keeps the state where it stopped
    (`keep_cancelled`), a next-turn prefetch what a tight budget left to a decode row it
    never has (`keep_left`); a request that decodes leaves it to its row."""
    if cancelled:
        keep_cancelled(task, grid=grid, store=store)
    elif task.job.background:
        keep_left(task, store=store)


def keep_cancelled(task: PrefillTask, *, grid: ChunkGrid, store: PromptCache) -> None:
    """The cancelled `task` is closed: store its state where it stopped, if anything."""
    if task.checkpointer is None:
        return
    if task.position > task.reuse and not task.cursor.done:
        # Between two chunks: the cache holds exactly the prefix up to a grid
        # point, computed alone (a stacked rest only ever ends a prompt: its
        # cursor is done).
        assert grid.is_point(task.tokens, task.position), "off the grid"
        keep_reached(
            task.checkpointer,
            task.position,
            let_go=lambda: store.drop_active(task.bytes_key),
        )
    else:  # at its end, or where it was restored: what was left to its decode
        keep_handed(
            task.checkpointer,
            task.position,
            let_go=lambda: store.drop_active(task.bytes_key),
        )


def keep_handed(checkpointer: Checkpointer, position: int, let_go: Callable[[], None]) -> None:
    """A request stopped at `position` before its decode row could store what was
    left to it (its end, `end_kind`; the entry the store handed over, `hand_back`):
    store that state from its cache instead, so a cancel loses no entry: its end
    where computed alone, else the restored prefix (it computed nothing, or a
    stacked forward did). The cache's buffers become the entry's (no copy: the
    budget had no room for one), so the request lets go of its bytes first
    (`let_go`); its cache must not be written again. Mutates the store."""
    if checkpointer.end_kind is not None and position == len(checkpointer.prompt.tokens):
        kind, checkpointer.end_kind = checkpointer.end_kind, None  # its end, computed alone
    elif checkpointer.hand_back:
        position, kind = checkpointer.reuse, CheckpointKind.HISTORY
    else:
        return
    _keep_live(checkpointer, position, kind, let_go)


def keep_left(task: PrefillTask, *, store: PromptCache) -> None:
    """A next-turn prefetch ends, at its end or giving way between two chunks (a grid
    point: its cache holds exactly that prefix, computed alone; a prefetch never
    stacks): when the store handed it the entry it extends, or its end was left to a
    decode row for lack of room (cache/handover.py), its cache where it stopped becomes
    the entry (views, no copy), in place of the one it was handed. Mutates the store."""
    checkpointer = task.checkpointer
    if checkpointer is None or not (checkpointer.hand_back or checkpointer.end_kind is not None):
        return
    kind = checkpointer.end_kind if task.cursor.done else None
    checkpointer.end_kind = None
    position = task.position
    let_go = lambda: store.drop_active(task.bytes_key)  # noqa: E731
    _keep_live(checkpointer, position, kind or CheckpointKind.HISTORY, let_go)


def _keep_live(
    checkpointer: Checkpointer, position: int, kind: CheckpointKind, let_go: Callable[[], None]
) -> None:
    """Store the first `position` positions of the cache as they are (views: its buffers
    become the entry's, so the request lets go of its bytes first) unless stored already;
    a hybrid's checkpoints left to the row too, sharing its KV. The cache must not be
    written again. Mutates the store."""
    tokens = checkpointer.prompt.tokens[:position]
    if position == 0 or checkpointer.store.get(checkpointer.key, tokens) is not None:
        return
    keep_live(checkpointer, position, kind, let_go)


def keep_reached(checkpointer: Checkpointer, position: int, let_go: Callable[[], None]) -> None:
    """A cancelled prefill stops at grid point `position` (the cache holds exactly
    that prefix, computed chunk by chunk on the grid): store its state there as
    CANCELLED, unless stored already, after the checkpoints it had deferred; and
    queue it for disk where the disk policy chose a save past it (the shutdown
    writes the queue: a restart resumes there). Where the budget cannot hold a piece
    beside the live cache (after a hand-over a piece would copy the whole prefix
    again), the cache's buffers become the entry's instead (`keep_live`). Call
    before `finish`; the cache is not changed. Mutates the store and the disk queue."""
    if checkpointer.finished or position <= checkpointer.reuse:
        return
    checkpointer.settle()
    tokens = checkpointer.prompt.tokens[:position]
    in_memory = checkpointer.store.get(checkpointer.key, tokens) is None
    disk, chosen = checkpointer.disk, checkpointer.disk_positions
    to_disk = (
        disk is not None
        and position not in chosen
        and any(p > position for p in chosen)
        and not disk.cache.holds(checkpointer.key, tokens)
    )
    if in_memory and not to_disk and (checkpointer.hand_back or checkpointer.no_room(position)):
        keep_live(checkpointer, position, CheckpointKind.CANCELLED, let_go)
    elif in_memory or to_disk:
        snapshot = checkpointer.capture_at(position)
        checkpointer.rows.store_inside(snapshot)  # a hybrid's checkpoints left to the row
        checkpointer.keep(snapshot, CheckpointKind.CANCELLED, in_memory, to_disk)


def keep_live(
    checkpointer: Checkpointer, position: int, kind: CheckpointKind, let_go: Callable[[], None]
) -> None:
    """Store the state at `position` from the live cache of a request that stops there:
    its buffers become the entry's (no copy), so the request lets go of its bytes first
    (`let_go`); its cache must not be written again. The checkpoints a hybrid kept
    without their KV share them. Mutates the store."""
    if hybrid(checkpointer.cache) and not at_offset(checkpointer.cache, position):
        return  # its recurrent layers went on past `position`: no exact state there
    snapshot = live_snapshot(checkpointer.cache, position)
    let_go()
    checkpointer.rows.store_inside(snapshot)  # a hybrid's checkpoints left to the row too
    if checkpointer.cancelled and kind <= PROTECTED_ABOVE:
        kind = CheckpointKind.CANCELLED
    if checkpointer.store.insert(
        checkpointer.key, checkpointer.prompt.tokens[:position], snapshot, kind
    ):
        checkpointer.on_stored(position)
