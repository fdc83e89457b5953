"""Prepared images kept between requests, in a byte cap.

A conversation sends the same screenshot again in every turn; preparing it (decode,
resize, normalise: vision/tower.py's `prepare`) each time is work a cache saves. What is
kept is the tower's input (pixel values: for Qwen3.5 about 24 bytes per pixel it takes),
never the request's encoded or decoded image, and it is bounded by bytes, least recently
used first out: a count of entries would let eight 4K screenshots hold gigabytes. An
entry larger than the whole cap is prepared and not kept.

Thread-safe: plans run on the server's worker threads (engine.submit).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class PreparedCache(Generic[T]):
    """`get(key, make)`: the value kept for `key`, else `make()` kept (when it fits)."""

    def __init__(self, nbytes: Callable[[T], int], max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self._nbytes = nbytes
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key: str, make: Callable[[], T]) -> T:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found[0]
        value = make()  # outside the lock: two threads may prepare one image, alike
        size = self._nbytes(value)
        if size <= self.max_bytes:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = (value, size)
                    self._held += size
                while self._held > self.max_bytes:
                    _, (_, old) = self._entries.popitem(last=False)
                    self._held -= old
        return value

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._held = 0
