"""The disk tier's file I/O: survey the directory, write atomically, remove, touch.

Never serve a wrong file (invariant 8):
- writes are atomic: a temp file `<name>.tmp-<pid>-<rand>` in the same directory,
  locked (flock) by its writer, flushed and fsynced, then `os.replace`d onto its name;
  a crash leaves at most a temp file, which a later scan removes once nobody holds its
  lock (the kernel drops the lock of a killed process; pids are reused, locks are not);
- a survey classifies as bad the files that are truncated, corrupt (the header is
  digested whole), of another format version, or whose token ids do not match their
  name, and abandoned temp files; it changes nothing on disk (the owner removes them).

No lock: the owner (`disk.DiskCache`) serialises what needs it. Pure Python (no MLX):
the checkpoint's bytes come from a `write` callback.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mlx_prefix.cache.disk import header as hdr
from mlx_prefix.cache.disk import trust
from mlx_prefix.cache.disk.index import DiskEntry, DiskEntryInfo

log = logging.getLogger("mlx_prefix.cache.disk")  # one logger for the whole disk tier

STALE_TEMP_S = 3600.0  # an unlocked empty temp file this old is abandoned (see _temp_abandoned)


@dataclass(frozen=True, slots=True)
class BadFile:
    name: str
    reason: str  # why a scan removes it
    nbytes: int


@dataclass(frozen=True, slots=True)
class Survey:
    found: list[DiskEntry]  # valid checkpoints, least recently used first
    bad: list[BadFile]


def survey(directory: Path) -> Survey:
    """Classify the files of `directory` by their headers. Changes nothing on disk.

    Files that are neither checkpoints nor our temp files are ignored; temp files still
    being written are neither found nor bad. A folder or file another user could have
    written is skipped with a warning (trust.py): neither found nor removed.
    """
    found: list[DiskEntry] = []
    bad: list[BadFile] = []
    try:
        trust.check_directory(directory)
        items = list(os.scandir(directory))
    except trust.Untrusted as e:
        log.warning("disk cache: nothing read from it: %s", e)
        items = []
    except OSError as e:
        log.warning("disk cache: cannot list %s: %s", directory, e)
        items = []
    for item in items:
        try:
            if not item.is_file(follow_symlinks=False):
                continue
            why = trust.untrusted(item.stat(follow_symlinks=False))
            if why is not None:
                log.warning("disk cache: skipping %s, never served: it is %s", item.path, why)
                continue
            if hdr.TEMP_RE.match(item.name):
                if _temp_abandoned(item):
                    reason = "an unfinished write (temp file)"
                    bad.append(BadFile(item.name, reason, item.stat().st_size))
                continue
            if not hdr.NAME_RE.match(item.name):
                continue
            stat = item.stat()
            try:
                header = hdr.read_header(Path(item.path))
                if hdr.entry_name(header.model_key, header.tokens) != item.name:
                    raise hdr.DiskFormatError("token ids do not match the file name")
            except hdr.DiskFormatError as e:
                bad.append(BadFile(item.name, str(e), stat.st_size))
                continue
        except OSError as e:
            log.warning("disk cache: cannot read %s: %s", item.path, e)
            continue
        found.append(
            DiskEntry(
                item.name,
                header.model_key,
                header.runtime,
                header.tokens,
                header.kind,
                header.trimmable,
                header.size,
                stat.st_mtime,
            )
        )
    found.sort(key=lambda e: e.last_access)
    return Survey(found, bad)


@dataclass(frozen=True, slots=True)
class DiskListing:
    """A read-only view of a cache directory."""

    directory: str
    exists: bool  # False: no such directory (nothing was created)
    entries: list[DiskEntryInfo]  # valid checkpoints of every model key, LRU first
    bad: list[BadFile]  # files the next scan removes: damaged, stale, unfinished writes


def listing(directory: Path) -> DiskListing:
    """What a scan of `directory` would index and remove: creates, removes and touches
    nothing. Reads headers only; every header is verified against its digest."""
    if not directory.is_dir():
        return DiskListing(str(directory), False, [], [])
    found = survey(directory)
    now = time.time()
    return DiskListing(str(directory), True, [e.info(now) for e in found.found], found.bad)


def write_atomic(directory: Path, name: str, write: Callable[[BinaryIO], None]) -> None:
    """Write a file `name` (mode 0600) in `directory` with `write(f)`, via a synced temp
    file. On failure the temp file is removed and the error propagates; a folder another
    user could read or write into is a PermissionError (nothing written)."""
    try:
        trust.check_directory(directory)
    except trust.Untrusted as e:
        raise PermissionError(errno.EACCES, str(e)) from None
    tmp = directory / f"{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, trust.FILE_MODE)
        os.fchmod(fd, trust.FILE_MODE)  # whatever the umask
        with os.fdopen(fd, "wb") as f:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed: see _temp_abandoned
            except OSError:
                pass  # no flock here: scans fall back on the pid in the name
            write(f)
            f.flush()
            os.fsync(fd)
            os.replace(tmp, directory / name)  # still locked: never seen abandoned
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def unlink(directory: Path, name: str) -> None:
    """Remove a file if present; a failure is logged, not raised."""
    try:
        (directory / name).unlink(missing_ok=True)
    except OSError as err:
        log.warning("disk cache: cannot remove %s: %s", name, err)


def remove_bad(directory: Path, name: str, why: str) -> int:
    """Remove a bad file, with a warning saying `why`. Returns 1 if removed."""
    log.warning("disk cache: removing %s: %s", directory / name, why)
    try:
        (directory / name).unlink(missing_ok=True)
        return 1
    except OSError as e:
        log.warning("disk cache: cannot remove %s: %s", name, e)
        return 0


def touch(directory: Path, name: str) -> None:
    """Set the file's mtime to now, so its recency survives a restart. A failure is
    logged (the file may then be evicted too early after a restart), not raised."""
    try:
        os.utime(directory / name)
    except OSError as e:
        log.warning("disk cache: cannot record the use of %s (its mtime): %s", name, e)


def _temp_abandoned(item: os.DirEntry) -> bool:
    """Whether a temp file's writer is gone. Changes nothing on disk.

    A writer locks its temp file before writing a byte and holds the lock until the
    file is renamed; the kernel releases it when the writer dies, even by SIGKILL. So
    an unlocked temp file with data is abandoned; an unlocked empty one may belong to a
    writer between its open and its lock, and is abandoned only once old. Where the
    file system has no flock, the writer's pid (in the name) decides.
    """
    try:
        fd = os.open(item.path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(fd)
        return st.st_size > 0 or time.time() - st.st_mtime > STALE_TEMP_S
    except BlockingIOError:
        return False  # being written
    except OSError:
        return _writer_gone(item)
    finally:
        os.close(fd)  # releases our lock, if taken


def _writer_gone(item: os.DirEntry) -> bool:
    """Without locks: the pid in the name is not running, or the file is old."""
    m = hdr.TEMP_RE.match(item.name)
    assert m is not None
    pid = int(m.group(1))
    try:
        if time.time() - item.stat().st_mtime > STALE_TEMP_S:
            return True
    except OSError:
        return False
    if pid == os.getpid():
        return False  # a save in this process may be writing it now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by someone else
    return False


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; best effort (not every file system supports it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
