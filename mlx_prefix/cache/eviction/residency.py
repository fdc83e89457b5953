"""Which buffers the stored entries keep alive, each counted once (invariant 6).

A payload lists the buffers it holds (`types.Buffer`): a snapshot's attention KV is a
chain of pieces that the entries of one conversation share (cache/chain.py: turn N+1's
chain is turn N's plus one piece), so summing the entries' sizes would count a piece
once per entry built on it. Here the resident total is the sum over distinct buffers;
removing an entry frees only the buffers no other entry holds; and for ranking (the
eviction policy), an entry's share is exactly that: what removing it now frees. A parent
whose children build on its piece frees its own state only (the piece stays theirs: a
fold, no copy); a leaf frees its piece too. Ranking by what each frees per prefill it
costs picks between the two, as Marconi does (a node with children keeps its KV for
them and offers only its recurrent state).

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mlx_prefix.cache.types import Buffer


@dataclass(slots=True)
class _Held:
    nbytes: int
    holders: set[int] = field(default_factory=set)  # entry ids


class Residency:
    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}  # buffer key -> its size and holders
        self.total = 0  # bytes of all held buffers, each once

    def add(self, entry_id: int, buffers: Iterable[Buffer]) -> set[int]:
        """`entry_id` now holds `buffers` (mutates). Returns the ids of every entry whose
        share changed (the new one included)."""
        changed = {entry_id}
        for b in buffers:
            held = self._held.get(b.key)
            if held is None:
                held = self._held[b.key] = _Held(b.nbytes)
                self.total += b.nbytes
            assert held.nbytes == b.nbytes, "one buffer key, two sizes"
            changed |= held.holders
            held.holders.add(entry_id)
        return changed

    def remove(self, entry_id: int, buffers: Iterable[Buffer]) -> set[int]:
        """`entry_id` no longer holds `buffers` (mutates); a buffer nobody holds is
        freed. Returns the ids of the remaining entries whose share changed."""
        changed: set[int] = set()
        for b in buffers:
            held = self._held[b.key]
            held.holders.remove(entry_id)
            if held.holders:
                changed |= held.holders
            else:
                del self._held[b.key]
                self.total -= held.nbytes
        return changed

    def share(self, buffers: Iterable[Buffer], joining: bool = False) -> float:
        """Bytes of `buffers` no other entry holds: what removing their holder frees;
        `joining`: what a candidate for insertion would add. Does not mutate."""
        total = 0.0
        for b in buffers:
            held = self._held.get(b.key)
            holders = (len(held.holders) if held else 0) + joining
            total += b.nbytes if holders <= 1 else 0.0
        return total

    def union(self, groups: Iterable[Iterable[Buffer]]) -> int:
        """Bytes of the distinct buffers among `groups`. Does not mutate."""
        seen: dict[int, int] = {}
        for buffers in groups:
            for b in buffers:
                seen[b.key] = b.nbytes
        return sum(seen.values())

    def holds(self, key: int) -> bool:
        """Whether an entry holds the buffer `key`. Does not mutate."""
        return key in self._held

    def holders(self, key: int) -> frozenset[int]:
        held = self._held.get(key)
        return frozenset(held.holders) if held else frozenset()

    def check_integrity(self, entries: dict[int, tuple[Buffer, ...]]) -> None:
        """Assert that the held buffers are exactly those of `entries` (id -> buffers)."""
        expected: dict[int, set[int]] = {}
        for entry_id, buffers in entries.items():
            for b in buffers:
                expected.setdefault(b.key, set()).add(entry_id)
        assert expected == {k: h.holders for k, h in self._held.items()}, "buffer holders"
        assert self.total == sum(h.nbytes for h in self._held.values()), "resident total"
