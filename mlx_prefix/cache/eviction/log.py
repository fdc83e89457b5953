"""What the store let go of: a small bounded record of evicted entries (and of entries
it refused to store for lack of room), so that a later miss can be told apart from a
prefix never seen (issue 46: the `evicted` reason).

Each record keeps a digest of the entry's token ids, not the ids: whether an evicted
entry was a prefix of some sequence is then one hash of that sequence's first bytes.
Pure Python (no MLX). Thread-safe: the store adds under its own lock (the engine
thread), the request explainer reads from its own thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from mlx_prefix.cache.token_ids import packed

EVICTED_RECORDS = 512  # the newest evictions kept; about 100 bytes each


@dataclass(frozen=True, slots=True)
class EvictedPrefix:
    key: str  # the entry's key (model, namespace, salt)
    length: int  # its tokens
    digest: int  # hash(packed ids): equal digests, same sequence (64 bits)
    trimmable: bool  # it served any common prefix (else only itself, exactly)
    nbytes: int  # what it held
    # Bytes over the budget when it went (or, refused, bytes missing for it to fit):
    # a budget larger by this much would have kept it. 0: the entry count limit.
    short: int
    at: float  # unix time
    refused: bool = False  # never stored: it did not fit


def digest(raw: bytes) -> int:
    return hash(raw)  # SipHash, cached on the bytes object; stable within this process


class EvictionLog:
    def __init__(self, size: int = EVICTED_RECORDS) -> None:
        self._records: deque[EvictedPrefix] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(
        self,
        key: str,
        tokens: Sequence[int],
        trimmable: bool,
        nbytes: int,
        short: int,
        *,
        refused: bool = False,
    ) -> None:
        """Record one entry let go (mutates). O(its length) once, to hash its ids."""
        record = EvictedPrefix(
            key, len(tokens), digest(packed(tokens)), trimmable, nbytes, max(0, short),
            time.time(), refused,
        )  # fmt: skip
        with self._lock:
            self._records.append(record)

    def of(self, key: str) -> list[EvictedPrefix]:
        """The records of entries under exactly `key`, newest first. Does not mutate."""
        with self._lock:
            return [r for r in reversed(self._records) if r.key == key]

    def __len__(self) -> int:
        return len(self._records)
