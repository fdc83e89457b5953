"""The prompt cache's eviction policy: in which order stored checkpoints go.

The policy only orders entries. The store (`store.PromptCache`) decides when to evict
(over its byte budget or entry cap) and which entries may go at all (never a pinned
or locked one): it takes the first evictable entry of `order()`.

Today's policy, `KindLRU`: lower `CheckpointKind` first (GENERATED < PERIODIC <
HISTORY < LAST_MESSAGE < SYSTEM), least recently used first within a kind.

A policy is not thread-safe: the store calls it with its lock held. It holds the
store's entries by reference and may read their fields at any time; the store tells
it of every change that can move an entry in its order (`add`, `remove`, `touch`,
`change_kind`).

Pure Python (no MLX).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from mlx_prefix.cache.records import CheckpointKind


class Evictable(Protocol):
    """What a policy may read of a stored entry (the store's own entry record)."""

    entry_id: int
    kind: CheckpointKind
    nbytes: int
    tokens: tuple[int, ...]
    last_access: float  # the store's clock at the last insert/acquire


E = TypeVar("E", bound=Evictable)


class EvictionPolicy(Protocol[E]):
    def add(self, e: E) -> None:
        """Track a newly stored entry, the most recently used one (mutates)."""
        ...

    def remove(self, e: E) -> None:
        """Stop tracking `e` (mutates)."""
        ...

    def touch(self, e: E) -> None:
        """`e` was just used; its `last_access` is already updated (mutates)."""
        ...

    def change_kind(self, e: E, old: CheckpointKind) -> None:
        """`e.kind` was just changed from `old` (mutates)."""
        ...

    def order(self) -> Iterator[E]:
        """Every tracked entry, the first to be evicted first. Does not mutate; do not
        change the policy while iterating."""
        ...

    def outlasts(self, e: E, kind: CheckpointKind, nbytes: int, length: int) -> bool:
        """Whether stored `e` would be evicted after a new entry of `kind`, `nbytes`
        and `length` tokens, added now. The policy's part of the "would it fit"
        decision: the store counts these entries, with the pinned and locked ones, as
        staying when the new entry is added. Does not mutate."""
        ...

    def check_integrity(self, entries: Mapping[int, E]) -> None:
        """Assert that the policy tracks exactly `entries` (by id). Does not mutate."""
        ...


class KindLRU(Generic[E]):
    """Lower kind first; within a kind, least recently used first."""

    def __init__(self) -> None:
        # Per kind, entries in recency order (least recent first): the eviction queues.
        self._queues: dict[CheckpointKind, OrderedDict[int, E]] = {
            k: OrderedDict() for k in CheckpointKind
        }

    def add(self, e: E) -> None:
        self._queues[e.kind][e.entry_id] = e

    def remove(self, e: E) -> None:
        del self._queues[e.kind][e.entry_id]

    def touch(self, e: E) -> None:
        self._queues[e.kind].move_to_end(e.entry_id)

    def change_kind(self, e: E, old: CheckpointKind) -> None:
        del self._queues[old][e.entry_id]
        self.add(e)

    def order(self) -> Iterator[E]:
        for kind in CheckpointKind:  # ascending: lower kinds go first
            yield from self._queues[kind].values()  # least recently used first

    def outlasts(self, e: E, kind: CheckpointKind, nbytes: int, length: int) -> bool:
        # The new entry would be the most recent of its kind: every entry of its kind or
        # a lower one goes before it.
        return e.kind > kind

    def check_integrity(self, entries: Mapping[int, E]) -> None:
        queued = {i: e for q in self._queues.values() for i, e in q.items()}
        assert queued.keys() == entries.keys(), "eviction queues != entries"
        for kind, q in self._queues.items():
            assert all(e.kind == kind for e in q.values()), "entry in wrong queue"
