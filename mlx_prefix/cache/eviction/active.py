"""Running requests' bytes in the store's budget, memory shared with entries counted once.

A running request reports the bytes its live cache holds, and which of them are
buffers a stored entry may hold too (`types.Buffer`): a prefill's end snapshot views
the very KV buffers its cache still holds, and a hybrid's checkpoints share the
prefill's final KV (cache/snapshot.py). Such a shared buffer counts as the request's
only while no stored entry holds it: storing the entry does not count it twice, and
evicting the entry does not pretend to free memory the request still holds. Requests
sharing one buffer count it once too.

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlx_prefix.cache.types import Buffer


@dataclass(slots=True)
class _Shared:
    nbytes: int
    requests: int  # how many running requests hold it


class ActiveBytes:
    def __init__(self) -> None:
        self._own: dict[str, int] = {}  # request -> bytes in buffers of its own
        self._shared_by: dict[str, tuple[Buffer, ...]] = {}  # request -> its shared buffers
        self._shared: dict[int, _Shared] = {}  # buffer key -> size, requests holding it
        self.own_total = 0

    def __len__(self) -> int:
        return len(self._own)

    def set(self, request_id: str, nbytes: int, shared: Iterable[Buffer] = ()) -> None:
        """`request_id` now holds `nbytes`, of which the distinct buffers `shared` may be
        held by stored entries too (mutates)."""
        distinct = tuple({b.key: b for b in shared}.values())
        own = nbytes - sum(b.nbytes for b in distinct)
        if own < 0:
            raise ValueError(f"shared buffers exceed the request's {nbytes} bytes")
        self.drop(request_id)
        self._own[request_id] = own
        self.own_total += own
        self._shared_by[request_id] = distinct
        for b in distinct:
            held = self._shared.setdefault(b.key, _Shared(b.nbytes, 0))
            assert held.nbytes == b.nbytes, "one buffer key, two sizes"
            held.requests += 1

    def drop(self, request_id: str) -> None:
        """Forget `request_id` (mutates). Unknown ids are ignored."""
        self.own_total -= self._own.pop(request_id, 0)
        for b in self._shared_by.pop(request_id, ()):
            held = self._shared[b.key]
            held.requests -= 1
            if not held.requests:
                del self._shared[b.key]

    def shared(self) -> list[Buffer]:
        """The distinct buffers running requests share (with entries or each other)."""
        return [Buffer(key, s.nbytes) for key, s in self._shared.items()]

    def total(self, stored: Callable[[int], bool]) -> int:
        """Bytes the running requests hold besides the buffers `stored(key)` says an
        entry holds. Does not mutate."""
        unstored = sum(s.nbytes for key, s in self._shared.items() if not stored(key))
        return self.own_total + unstored

    def check_integrity(self) -> None:
        assert self.own_total == sum(self._own.values()), "active own total"
        assert self._own.keys() == self._shared_by.keys(), "active requests"
        counts: dict[int, int] = {}
        for buffers in self._shared_by.values():
            for b in buffers:
                counts[b.key] = counts.get(b.key, 0) + 1
        assert counts == {k: s.requests for k, s in self._shared.items()}, "shared refs"
