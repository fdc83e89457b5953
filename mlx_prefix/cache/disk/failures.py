"""What a failed load or save does: a load's error triaged (only proven damage removes
the file), a save's warned once per errno until a save succeeds.

A failure of the disk tier never fails serving: a failed load is a miss, a failed save
stores nothing (and leaves no partial file: `files.write_atomic`). Pure Python (no MLX).
Not thread-safe: `tier.DiskCache` calls in with its lock held, except `warn_save`, which
only logs.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from mlx_prefix.cache.disk import files, trust
from mlx_prefix.cache.disk import header as hdr
from mlx_prefix.cache.disk.index import DiskIndex
from mlx_prefix.cache.disk.stats import DiskCounters

log = logging.getLogger("mlx_prefix.cache.disk")

_HINTS = {
    errno.ENOSPC: " (disk full)",
    errno.EROFS: " (read-only file system)",
    errno.EACCES: " (permission denied)",
}


def load_failed(
    directory: Path, index: DiskIndex, counters: DiskCounters, name: str, error: Exception
) -> None:
    """Count a failed load of file `name`; remove the file only when it is proven damaged.
    A transient error (MemoryError, EMFILE, EIO, ...) or an unexpected one keeps the file
    and its index entry: a later request may load it."""
    why = f"{type(error).__name__}: {error}"
    counters.load_failures += 1
    counters.misses += 1
    if isinstance(error, FileNotFoundError):
        index.drop(name)
        log.warning("disk cache: %s vanished; dropped from the index", name)
    elif isinstance(error, trust.Untrusted):
        index.drop(name)  # another user's doing, perhaps: not ours to delete
        log.warning("disk cache: %s is not served: %s", name, error)
    elif isinstance(error, hdr.ForeignRuntime):
        index.drop(name)  # another server's valid file: leave it on disk
        log.warning("disk cache: %s is now %s; left on disk, not served", name, error)
    elif isinstance(error, hdr.DiskFormatError):
        index.drop(name)
        counters.removed += files.remove_bad(directory, name, f"cannot load: {why}")
    else:
        log.warning("disk cache: cannot load %s now (%s); the file is kept", name, why)


class SaveWarnings:
    """The errnos already warned of since the last successful save."""

    def __init__(self) -> None:
        self._warned: set[int] = set()

    def first(self, err: int | None) -> bool:
        """Whether a failure with `err` (None: no errno) is to be warned of (mutates)."""
        first = err is None or err not in self._warned
        if err is not None:
            self._warned.add(err)
        return first

    def saved(self) -> None:
        """A save succeeded: the next failure of any errno is warned of again."""
        self._warned.clear()


def warn_save(message: str, err: int | None, first: bool) -> None:
    """Log a failed save: a warning the first time (`SaveWarnings.first`), else debug."""
    if first:
        log.warning("disk cache: checkpoint not saved%s: %s", _HINTS.get(err or 0, ""), message)
    else:
        log.debug("disk cache: checkpoint not saved: %s", message)
