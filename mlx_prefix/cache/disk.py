"""The disk tier: checkpoints as files that outlive the process (DESIGN 8).

One safetensors file per checkpoint (format: `disk_format`), named by a strong hash
of (model key, token ids). The index lives in memory, rebuilt by `scan` from file
headers alone; tensors are read only by `load`.

Never serve a wrong file:
- writes are atomic: a temp file `<name>.tmp-<pid>-<rand>` in the same directory,
  locked (flock) by its writer, flushed and fsynced, then `os.replace`d onto its name;
  a crash leaves at most a temp file, which a later scan removes once nobody holds its
  lock (the kernel drops the lock of a killed process; pids are reused, locks are not);
- a scan removes, with a warning, files that are truncated, corrupt (the header is
  digested whole), of another format version, or whose token ids do not match their
  name; `listing` reports the same without touching the directory;
- `load` reads the file once: its header verified and checked against the index
  (model key, token ids, runtime), its tensor data against its digest, before the
  Snapshot is returned; any failure removes the file (warning) and is a miss.
Files of other model keys, or written under another mlx-lm version, are indexed and
count against the byte budget, but never match this model (each has its own trie).

Eviction: least recently used first (access = save or load; persisted as the file's
mtime so it survives restarts), across every file in the directory, until the files
fit `budget_bytes`. Only files this process has indexed are counted: two servers
sharing a directory each keep their own view (each enforces the budget on it).

Thread-safety: every public method may be called from any thread; the index is
guarded by one lock. `save` and `load` read and build MLX arrays: call them on the
engine thread (DESIGN 1). File I/O runs outside the lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlx_prefix.cache import disk_format as fmt
from mlx_prefix.cache.snapshot import Snapshot
from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.cache.trie import TokenTrie

log = logging.getLogger("mlx_prefix.cache.disk")

GiB = 1 << 30
DEFAULT_DISK_BUDGET = 16 * GiB
HISTORY = CheckpointKind.HISTORY
STALE_TEMP_S = 3600.0  # an unlocked empty temp file this old is abandoned (see _temp_abandoned)


@dataclass(frozen=True, slots=True)
class DiskMatch:
    name: str  # file name of the entry to load
    model_key: str
    tokens: tuple[int, ...]  # the stored sequence (what `load` checks the file against)
    reuse_tokens: int  # tokens the request gets (after trim/alignment), > 0
    trim: int  # tokens to drop from the loaded snapshot's end: restore(s, trim=trim)
    matched_tokens: int  # longest common prefix with any stored sequence (diagnostic)
    nbytes: int  # file size
    kind: CheckpointKind  # as saved (e.g. to promote the loaded snapshot into memory)


@dataclass(frozen=True, slots=True)
class DiskEntryInfo:
    name: str
    model_key: str
    runtime: str  # "mlx-lm <version>" that wrote it; other runtimes never match
    tokens: int  # sequence length
    kind: str  # CheckpointKind name
    trimmable: bool
    nbytes: int  # file size
    idle_s: float  # since the last save/load (mtime across restarts)


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


@dataclass(frozen=True, slots=True)
class BadFile:
    name: str
    reason: str  # why a scan removes it
    nbytes: int


@dataclass(frozen=True, slots=True)
class DiskListing:
    """A read-only view of a cache directory (`DiskCache.listing`)."""

    directory: str
    exists: bool  # False: no such directory (nothing was created)
    entries: list[DiskEntryInfo]  # valid checkpoints of every model key, LRU first
    bad: list[BadFile]  # files the next scan removes: damaged, stale, unfinished writes


@dataclass(frozen=True, slots=True)
class _Survey:
    found: list[_Entry]  # valid checkpoints, least recently used first
    bad: list[BadFile]


@dataclass(slots=True, eq=False)
class _Entry:
    name: str
    model_key: str
    runtime: str
    tokens: tuple[int, ...]
    kind: str
    trimmable: bool
    nbytes: int
    last_access: float  # time.time()


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    saves: int = 0
    save_failures: int = 0
    load_failures: int = 0
    evictions: int = 0
    removed: int = 0


class DiskCache:
    def __init__(
        self,
        directory: Path | str,
        budget_bytes: int | None = DEFAULT_DISK_BUDGET,
        *,
        runtime: str | None = None,
        scan: bool = True,
    ) -> None:
        """Open (creating it if needed) the cache directory and, unless `scan=False`,
        index the files already there (evicting down to the budget). `budget_bytes=None`
        never evicts (e.g. a CLI listing the directory). A directory that cannot be
        created is logged; every save then fails softly."""
        assert budget_bytes is None or budget_bytes >= 0
        self.directory = Path(directory).expanduser()
        self.budget_bytes = budget_bytes
        self.runtime = runtime or fmt.runtime_tag()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._tries: dict[tuple[str, str], TokenTrie[_Entry]] = {}  # (model key, runtime)
        self._bytes = 0
        self._counters = _Counters()
        self._warned_errnos: set[int] = set()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("disk cache: cannot create %s: %s", self.directory, e)
        if scan:
            self.scan()

    # -- index --------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the index from the directory (mutates; reads headers only).

        Removes, with a warning each: files that are truncated or corrupt, of another
        format version, whose token ids do not match their name, and temp files whose
        writer is gone. Other files are left alone. Returns the number of files indexed.
        """
        survey = _survey(self.directory)
        removed = sum(self._remove_file(b.name, b.reason) for b in survey.bad)
        with self._lock:
            self._entries.clear()
            self._tries.clear()
            self._bytes = 0
            self._counters.removed += removed
            for e in survey.found:
                self._add(e)
            self._evict(keep=None)
            return len(self._entries)

    @staticmethod
    def listing(directory: Path | str) -> DiskListing:
        """What a scan of `directory` would index and remove, without changing anything:
        creates, removes and touches nothing (for `mlx-prefix cache ls`). Reads headers
        only; every header is verified against its digest."""
        directory = Path(directory).expanduser()
        if not directory.is_dir():
            return DiskListing(str(directory), False, [], [])
        survey = _survey(directory)
        now = time.time()
        entries = [_info(e, now) for e in survey.found]
        return DiskListing(str(directory), True, entries, survey.bad)

    # -- lookup -------------------------------------------------------------

    def match(
        self, model_key: str, tokens: Sequence[int], align: Callable[[int], int]
    ) -> DiskMatch | None:
        """The stored checkpoint giving the longest reuse for `tokens` (DESIGN 3), or None.

        `align(n)` is the largest grid point <= n. Same rules as the memory store:
        trimmable entries reuse their common prefix with `tokens`, aligned and capped
        at len(tokens) - 1; non-trimmable ones only when their whole sequence is a
        prefix of `tokens` on the grid and at most len(tokens) - 1 long. Only entries
        of `model_key` written by this runtime. Does not read files or refresh recency
        (`load` does); a None counts as a miss.
        """
        with self._lock:
            best = self._best(model_key, tokens, align)
            if best is None:
                self._counters.misses += 1
            return best

    def load(self, match: DiskMatch) -> Snapshot | None:
        """Read, verify and return the matched checkpoint (reads the whole file, once).

        Checks the file's header against its digest, its model key, token ids and
        runtime against the match, and its tensor data against the stored digest. On
        any failure the file is removed (warning) and the result is None, counted as a
        miss. Refreshes the entry's recency on success. Call on the engine thread: it
        builds MLX arrays.
        """
        path = self.directory / match.name
        with self._lock:
            if match.name not in self._entries:
                self._counters.misses += 1
                return None  # evicted or cleared since the match
        try:
            snapshot = fmt.load(path, match.model_key, match.tokens, self.runtime)
        except Exception as e:  # whatever is wrong with the file, it must not be served
            with self._lock:
                self._counters.load_failures += 1
                self._counters.misses += 1
                self._drop(match.name)
                if isinstance(e, FileNotFoundError):
                    log.warning("disk cache: %s vanished; dropped from the index", match.name)
                else:
                    self._counters.removed += self._remove_file(
                        match.name, f"cannot load: {type(e).__name__}: {e}"
                    )
            return None
        with self._lock:
            self._counters.hits += 1
            e = self._entries.get(match.name)
            if e is not None:
                self._touch(e)
        return snapshot

    # -- mutation -----------------------------------------------------------

    def save(
        self, model_key: str, tokens: Sequence[int], snapshot: Snapshot, kind: CheckpointKind
    ) -> bool:
        """Write a checkpoint of `tokens` atomically, then evict to the budget (mutates).

        Returns True when the checkpoint is on disk afterwards: written now, already
        stored (refreshed), or covered by a stored trimmable extension. Returns False
        without raising when nothing could be written (disk full, read-only, permission,
        any OSError or other error while writing; an unstorable state; larger than the
        whole budget); a warning says why (once per errno until a save succeeds) and no
        partial file is left behind. A trimmable save removes stored
        trimmable strict prefixes (restoring this one with a trim serves them).
        Synchronous; call on the engine thread between requests.
        """
        tokens = tuple(tokens)
        if snapshot.length != len(tokens):
            raise ValueError(f"snapshot length {snapshot.length} != {len(tokens)} tokens")
        name = fmt.entry_name(model_key, tokens)
        with self._lock:
            if self._covered(name, model_key, tokens, snapshot.trimmable):
                return True
        try:
            enc = fmt.encode(snapshot, model_key, tokens, kind.name, self.runtime)
        except ValueError as e:
            return self._save_failed(f"cannot store this cache: {e}", None)
        if self.budget_bytes is not None and enc.size > self.budget_bytes:
            log.info(
                "disk cache: %d-byte checkpoint exceeds the %d-byte budget; not saved",
                enc.size,
                self.budget_bytes,
            )
            with self._lock:
                self._counters.save_failures += 1
            return False
        try:
            self._write_atomic(name, enc)
        except OSError as e:
            return self._save_failed(f"cannot write {self.directory / name}: {e}", e.errno)
        except Exception as e:  # e.g. MemoryError: a disk tier failure never fails serving
            why = f"cannot write {self.directory / name}: {type(e).__name__}: {e}"
            return self._save_failed(why, None)
        with self._lock:
            self._warned_errnos.clear()
            self._counters.saves += 1
            old = self._entries.get(name)
            if old is not None:  # saved concurrently under the same name
                self._drop(name)
            e = _Entry(
                name,
                model_key,
                self.runtime,
                tokens,
                kind.name,
                snapshot.trimmable,
                enc.size,
                time.time(),
            )
            self._add(e)
            if e.trimmable:
                trie = self._tries[(model_key, self.runtime)]
                for anc in trie.match(tokens).ancestors:
                    if anc.value is not e and anc.value.trimmable:
                        self._unlink_entry(anc.value)
            self._evict(keep=name)
        return True

    def clear(self, model_key: str | None = None) -> int:
        """Remove the indexed files of `model_key` (every runtime), or all indexed files.
        Mutates. Returns the number removed."""
        with self._lock:
            victims = [
                e for e in self._entries.values() if model_key is None or e.model_key == model_key
            ]
            for e in victims:
                self._unlink_entry(e)
            return len(victims)

    def set_budget(self, budget_bytes: int | None) -> None:
        """Change the budget (None: unlimited; mutates); evicts down to it."""
        assert budget_bytes is None or budget_bytes >= 0
        with self._lock:
            self.budget_bytes = budget_bytes
            self._evict(keep=None)

    # -- introspection ------------------------------------------------------

    def entries(self, model_key: str | None = None) -> list[DiskEntryInfo]:
        """Indexed files (of one model key, or all), least recently used first. Does not
        mutate."""
        now = time.time()
        with self._lock:
            return [
                _info(e, now)
                for e in self._entries.values()
                if model_key is None or e.model_key == model_key
            ]

    def stats(self) -> DiskStats:
        """A consistent snapshot of the counters. Does not mutate."""
        with self._lock:
            c = self._counters
            return DiskStats(
                directory=str(self.directory),
                files=len(self._entries),
                bytes=self._bytes,
                budget_bytes=self.budget_bytes,
                hits=c.hits,
                misses=c.misses,
                saves=c.saves,
                save_failures=c.save_failures,
                load_failures=c.load_failures,
                evictions=c.evictions,
                removed=c.removed,
            )

    def check_integrity(self) -> None:
        """Assert the index's invariants. Does not mutate."""
        with self._lock:
            assert self._bytes == sum(e.nbytes for e in self._entries.values()), "byte total"
            limit = self.budget_bytes
            assert limit is None or self._bytes <= limit or len(self._entries) <= 1, "budget"
            count = 0
            for (model_key, runtime), trie in self._tries.items():
                trie.check_integrity()
                assert len(trie), "empty trie kept"
                for item in trie.items():
                    e = item.value
                    assert self._entries.get(e.name) is e, "trie points at a dropped entry"
                    assert (e.model_key, e.runtime, e.tokens) == (model_key, runtime, item.tokens)
                    assert fmt.entry_name(e.model_key, e.tokens) == e.name, "name/key"
                    count += 1
            assert count == len(self._entries), "entries missing from the tries"

    # -- internals (with the lock held unless said otherwise) ----------------

    def _best(
        self, model_key: str, tokens: Sequence[int], align: Callable[[int], int]
    ) -> DiskMatch | None:
        trie = self._tries.get((model_key, self.runtime))
        if trie is None:
            return None
        limit = len(tokens) - 1  # leave at least one token to compute
        m = trie.match(tokens)
        best: tuple[int, int, _Entry] | None = None  # (reuse, trim, entry)
        for anc in m.ancestors:
            n = anc.length
            if not anc.value.trimmable and 0 < n <= limit and align(n) == n:
                if best is None or n > best[0]:
                    best = (n, 0, anc.value)
        near = trie.nearest(tokens, lambda e: e.trimmable)
        if near is not None:
            cap = min(near.common, limit)
            reuse = align(cap) if cap > 0 else 0
            assert 0 <= reuse <= cap, f"align({cap}) = {reuse}"
            trim = len(near.entry.tokens) - reuse
            if reuse > 0 and (best is None or (reuse, -trim) > (best[0], -best[1])):
                best = (reuse, trim, near.entry.value)
        if best is None:
            return None
        reuse, trim, e = best
        kind = CheckpointKind[e.kind] if e.kind in CheckpointKind.__members__ else HISTORY
        return DiskMatch(e.name, e.model_key, e.tokens, reuse, trim, m.matched, e.nbytes, kind)

    def _covered(self, name: str, model_key: str, tokens: tuple[int, ...], trimmable: bool) -> bool:
        """Whether a save of `tokens` is redundant; refreshes what covers it."""
        e = self._entries.get(name)
        if e is None and trimmable:
            trie = self._tries.get((model_key, self.runtime))
            if trie is not None:
                e = next((x.value for x in trie.extensions(tokens) if x.value.trimmable), None)
        if e is None:
            return False
        self._touch(e)
        return True

    def _add(self, e: _Entry) -> None:
        self._entries[e.name] = e
        self._tries.setdefault((e.model_key, e.runtime), TokenTrie()).insert(e.tokens, e)
        self._bytes += e.nbytes

    def _drop(self, name: str) -> _Entry | None:
        e = self._entries.pop(name, None)
        if e is None:
            return None
        key = (e.model_key, e.runtime)
        trie = self._tries[key]
        trie.remove(e.tokens)
        if not len(trie):
            del self._tries[key]
        self._bytes -= e.nbytes
        return e

    def _touch(self, e: _Entry) -> None:
        e.last_access = time.time()
        self._entries.move_to_end(e.name)
        try:
            os.utime(self.directory / e.name)  # recency survives a restart
        except OSError:
            pass

    def _evict(self, keep: str | None) -> None:
        while self.budget_bytes is not None and self._bytes > self.budget_bytes:
            victim = next((e for e in self._entries.values() if e.name != keep), None)
            if victim is None:
                return
            self._unlink_entry(victim)
            self._counters.evictions += 1

    def _unlink_entry(self, e: _Entry) -> None:
        self._drop(e.name)
        try:
            (self.directory / e.name).unlink(missing_ok=True)
        except OSError as err:
            log.warning("disk cache: cannot remove %s: %s", e.name, err)

    def _remove_file(self, name: str, why: str) -> int:
        """Remove a bad file, with a warning (lock not needed). Returns 1 if removed."""
        log.warning("disk cache: removing %s: %s", self.directory / name, why)
        try:
            (self.directory / name).unlink(missing_ok=True)
            return 1
        except OSError as e:
            log.warning("disk cache: cannot remove %s: %s", name, e)
            return 0

    def _save_failed(self, message: str, err: int | None) -> bool:
        """Count a failed save; warn once per errno until a save succeeds."""
        with self._lock:
            self._counters.save_failures += 1
            first = err is None or err not in self._warned_errnos
            if err is not None:
                self._warned_errnos.add(err)
        if first:
            hint = {
                errno.ENOSPC: " (disk full)",
                errno.EROFS: " (read-only file system)",
                errno.EACCES: " (permission denied)",
            }.get(err or 0, "")
            log.warning("disk cache: checkpoint not saved%s: %s", hint, message)
        else:
            log.debug("disk cache: checkpoint not saved: %s", message)
        return False

    def _write_atomic(self, name: str, enc: fmt.Encoded) -> None:
        """Write `enc` under `name` via a synced temp file (no index lock held). On failure
        the temp file is removed and the error propagates."""
        tmp = self.directory / f"{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed: see _temp_abandoned
                except OSError:
                    pass  # no flock here: scans fall back on the pid in the name
                fmt.write(f, enc)
                f.flush()
                os.fsync(fd)
                os.replace(tmp, self.directory / name)  # still locked: never seen abandoned
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise
        _fsync_dir(self.directory)


def _info(e: _Entry, now: float) -> DiskEntryInfo:
    return DiskEntryInfo(
        e.name,
        e.model_key,
        e.runtime,
        len(e.tokens),
        e.kind,
        e.trimmable,
        e.nbytes,
        max(0.0, now - e.last_access),
    )


def _survey(directory: Path) -> _Survey:
    """Classify the files of `directory` by their headers. Changes nothing on disk.

    Files that are neither checkpoints nor our temp files are ignored; temp files still
    being written are neither found nor bad.
    """
    found: list[_Entry] = []
    bad: list[BadFile] = []
    try:
        items = list(os.scandir(directory))
    except OSError as e:
        log.warning("disk cache: cannot list %s: %s", directory, e)
        items = []
    for item in items:
        try:
            if not item.is_file(follow_symlinks=False):
                continue
            if fmt.TEMP_RE.match(item.name):
                if _temp_abandoned(item):
                    reason = "an unfinished write (temp file)"
                    bad.append(BadFile(item.name, reason, item.stat().st_size))
                continue
            if not fmt.NAME_RE.match(item.name):
                continue
            stat = item.stat()
            try:
                header = fmt.read_header(Path(item.path))
                if fmt.entry_name(header.model_key, header.tokens) != item.name:
                    raise fmt.DiskFormatError("token ids do not match the file name")
            except fmt.DiskFormatError as e:
                bad.append(BadFile(item.name, str(e), stat.st_size))
                continue
        except OSError as e:
            log.warning("disk cache: cannot read %s: %s", item.path, e)
            continue
        found.append(
            _Entry(
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
    return _Survey(found, bad)


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
    m = fmt.TEMP_RE.match(item.name)
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
