"""The disk tier's counters and the DiskStats snapshot built from them.

Pure Python (no MLX). Not thread-safe: `tier.DiskCache` updates and reads them with its
lock held.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class DiskStats:
    directory: str
    files: int  # indexed checkpoint files (every model key)
    bytes: int  # their total size
    budget_bytes: int | None  # None: unlimited
    hits: int  # successful loads
    misses: int  # match() calls without a usable entry, plus failed loads
    saves: int  # files written
    save_failures: int  # saves that wrote nothing (I/O errors, unstorable, too large)
    load_failures: int  # loads that found a missing, corrupt or mismatched file
    evictions: int  # files removed for the budget
    removed: int  # corrupt, stale or leftover files removed by scan/load


@dataclass(slots=True)
class DiskCounters:
    hits: int = 0
    misses: int = 0
    saves: int = 0
    save_failures: int = 0
    load_failures: int = 0
    evictions: int = 0
    removed: int = 0

    def stats(self, directory: str, files: int, nbytes: int, budget_bytes: int | None) -> DiskStats:
        """The counters with what is indexed now. Does not mutate."""
        return DiskStats(
            directory=directory,
            files=files,
            bytes=nbytes,
            budget_bytes=budget_bytes,
            **asdict(self),  # every counter, under its own name
        )
