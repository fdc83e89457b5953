"""The disk tier: checkpoints as files that outlive the process (invariant 8).

One safetensors file per checkpoint (format: `header.py`, `payload.py`), named by
a strong hash of (model key, token ids). `DiskCache` is the tier's one entry point; its
parts: the in-memory index (`index.py`: matching, LRU order, byte budget), rebuilt
by `scan` from file headers alone, and the file I/O (`files.py`: atomic writes,
directory survey). Tensors are read only by `load`.

Never serve a wrong file:
- writes are atomic (temp file, flock, fsync, rename); a crash leaves at most a temp
  file, which a later scan removes once its writer is gone (`files.py`);
- a scan removes, with a warning, files that are truncated, corrupt (the header is
  digested whole), of another format version, or whose token ids do not match their
  name; `listing` reports the same without touching the directory;
- `load` reads the file once: its header verified and checked against the index
  (model key, token ids, runtime), its tensor data against its digest, before the
  Snapshot is returned; a failure is a miss (warning). Only proven damage removes the
  file: a transient error (MemoryError, EMFILE, ...) keeps it indexed for a retry, and
  another runtime's valid file is dropped from the index but left on disk.
Every removal is logged: damaged files (warning), evictions and redundant prefixes
(info), with the reason.
Files of other model keys, or written under another mlx-lm version, are indexed and
count against the byte budget, but never match this model (each has its own trie).

Eviction: least recently used first (access = save or load; persisted as the file's
mtime so it survives restarts), across every file in the directory, until the files
fit `budget_bytes`. Only files this process has indexed are counted: two servers
sharing a directory each keep their own view (each enforces the budget on it).

Thread-safety: every public method may be called from any thread; the index is
guarded by one lock. `save` and `load` read and build MLX arrays: call them on the
engine thread (invariant 1). File I/O runs outside the lock.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlx_prefix.cache.disk import files, payload, trust
from mlx_prefix.cache.disk import header as hdr
from mlx_prefix.cache.disk.files import DiskListing
from mlx_prefix.cache.disk.index import DiskEntry, DiskEntryInfo, DiskIndex, DiskMatch
from mlx_prefix.cache.snapshot import Snapshot
from mlx_prefix.cache.types import CheckpointKind, StoredTokens, covers

log = logging.getLogger("mlx_prefix.cache.disk")

GiB = 1 << 30
DEFAULT_DISK_BUDGET = 16 * GiB


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
        self.runtime = runtime or hdr.runtime_tag()
        self._lock = threading.Lock()
        self._index = DiskIndex(self.runtime)
        self._counters = _Counters()
        self._warned_errnos: set[int] = set()
        trust.make_private(self.directory)
        if scan:
            self.scan()

    # -- index --------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the index from the directory (mutates; reads headers only).

        Removes, with a warning each: files that are truncated or corrupt, of another
        format version, whose token ids do not match their name, and temp files whose
        writer is gone. Other files are left alone. Returns the number of files indexed.
        """
        survey = files.survey(self.directory)
        removed = sum(files.remove_bad(self.directory, b.name, b.reason) for b in survey.bad)
        with self._lock:
            self._index.reset(survey.found)
            self._counters.removed += removed
            self._evict(keep=None, why="at startup (a lower budget, or shared with a server)")
            return len(self._index)

    @staticmethod
    def listing(directory: Path | str) -> DiskListing:
        """What a scan of `directory` would index and remove, without changing anything
        (for `mlx-prefix cache ls`): see `files.listing`."""
        return files.listing(Path(directory).expanduser())

    # -- lookup -------------------------------------------------------------

    def match(
        self, model_key: str, tokens: Sequence[int], align: Callable[[int], int]
    ) -> DiskMatch | None:
        """The stored checkpoint giving the longest reuse for `tokens` (invariant 3), or None.

        `align(n)` is the largest grid point <= n. Same rules as the memory store:
        trimmable entries reuse their common prefix with `tokens`, aligned and capped
        at len(tokens) - 1; non-trimmable ones only when their whole sequence is a
        prefix of `tokens` on the grid and at most len(tokens) - 1 long. Only entries
        of `model_key` written by this runtime. Does not read files or refresh recency
        (`load` does); a None counts as a miss.
        """
        with self._lock:
            best = self._index.best(model_key, tokens, align)
            if best is None:
                self._counters.misses += 1
            return best

    def holds(self, model_key: str, tokens: Sequence[int]) -> bool:
        """Whether the checkpoint of exactly `tokens` is indexed. Does not mutate."""
        with self._lock:
            return hdr.entry_name(model_key, tuple(tokens)) in self._index

    def load(self, match: DiskMatch) -> Snapshot | None:
        """Read, verify and return the matched checkpoint (reads the whole file, once).

        Checks the file's header against its digest, its model key, token ids and
        runtime against the match, and its tensor data against the stored digest. Any
        failure returns None (a miss, with a warning); only proven damage removes the
        file (see `_load_failed`). Refreshes the entry's recency on success. Call on the
        engine thread: it builds MLX arrays.
        """
        path = self.directory / match.name
        with self._lock:
            if match.name not in self._index:
                self._counters.misses += 1
                return None  # evicted or cleared since the match
        try:
            snapshot = payload.load(path, match.model_key, match.tokens, self.runtime)
        except Exception as e:  # whatever is wrong, this file is not served now
            self._load_failed(match.name, e)
            return None
        with self._lock:
            self._counters.hits += 1
            entry = self._index.get(match.name)
            if entry is not None:
                self._touch(entry)
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
        name = hdr.entry_name(model_key, tokens)
        with self._lock:
            covering = self._index.covering(name, model_key, tokens, snapshot.trimmable)
            if covering is not None:
                self._touch(covering)
                return True
        try:
            enc = payload.encode(snapshot, model_key, tokens, kind.name, self.runtime)
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
            files.write_atomic(self.directory, name, lambda f: payload.write(f, enc))
        except OSError as e:
            return self._save_failed(f"cannot write {self.directory / name}: {e}", e.errno)
        except Exception as e:  # e.g. MemoryError: a disk tier failure never fails serving
            why = f"cannot write {self.directory / name}: {type(e).__name__}: {e}"
            return self._save_failed(why, None)
        with self._lock:
            self._warned_errnos.clear()
            self._counters.saves += 1
            self._index.drop(name)  # if saved concurrently under the same name
            entry = DiskEntry(
                name,
                model_key,
                self.runtime,
                tokens,
                kind.name,
                snapshot.trimmable,
                enc.size,
                time.time(),
            )
            self._index.add(entry)
            if entry.trimmable:
                for prefix in self._index.served_prefixes(entry):
                    self._unlink_entry(prefix, f"{name} serves it by trimming")
            self._evict(keep=name, why="after a save")
        return True

    def clear(self, model_key: str | None = None) -> int:
        """Remove the indexed files of the keys `model_key` covers (every runtime), or all
        indexed files. Mutates. Returns the number removed."""
        with self._lock:
            victims = [
                e
                for e in self._index.entries()
                if model_key is None or covers(model_key, e.model_key)
            ]
            for e in victims:
                self._unlink_entry(e, "cleared")
            if victims:
                log.info("disk cache: cleared %d file(s) from %s", len(victims), self.directory)
            return len(victims)

    def set_budget(self, budget_bytes: int | None) -> None:
        """Change the budget (None: unlimited; mutates); evicts down to it."""
        assert budget_bytes is None or budget_bytes >= 0
        with self._lock:
            self.budget_bytes = budget_bytes
            self._evict(keep=None, why="the budget was lowered")

    # -- introspection ------------------------------------------------------

    def entries(self, model_key: str | None = None) -> list[DiskEntryInfo]:
        """Indexed files (of the keys `model_key` covers, or all), least recently used
        first. Does not mutate."""
        now = time.time()
        with self._lock:
            return [
                e.info(now)
                for e in self._index.entries()
                if model_key is None or covers(model_key, e.model_key)
            ]

    def sequences(self, model_key: str) -> list[StoredTokens[DiskEntryInfo]]:
        """The files of the keys `model_key` covers that this runtime can serve, least
        recently used first, with their token ids (references to the index's tuples).
        Does not mutate."""
        now = time.time()
        with self._lock:
            return [
                StoredTokens(e.info(now), e.tokens)
                for e in self._index.entries()
                if covers(model_key, e.model_key) and e.runtime == self.runtime
            ]

    def stats(self) -> DiskStats:
        """A consistent snapshot of the counters. Does not mutate."""
        with self._lock:
            c = self._counters
            return DiskStats(
                directory=str(self.directory),
                files=len(self._index),
                bytes=self._index.bytes,
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
            self._index.check_integrity(self.budget_bytes)

    # -- internals (with the lock held unless said otherwise) ----------------

    def _touch(self, e: DiskEntry) -> None:
        self._index.touch(e)
        files.touch(self.directory, e.name)  # recency survives a restart

    def _evict(self, keep: str | None, why: str) -> None:
        for victim in self._index.evict(self.budget_bytes, keep):
            log.info(
                "disk cache: evicting %s (%d tokens, %d bytes, idle %.0fs) for the %s-byte "
                "budget, %s",
                victim.name, len(victim.tokens), victim.nbytes,
                max(0.0, time.time() - victim.last_access), self.budget_bytes, why,
            )  # fmt: skip
            files.unlink(self.directory, victim.name)
            self._counters.evictions += 1

    def _unlink_entry(self, e: DiskEntry, why: str) -> None:
        self._index.drop(e.name)
        if why != "cleared":  # `clear` logs one line for all
            log.info("disk cache: removing %s (%d tokens): %s", e.name, len(e.tokens), why)
        files.unlink(self.directory, e.name)

    def _load_failed(self, name: str, error: Exception) -> None:
        """Count a failed load; remove the file only when it is proven damaged (takes
        the lock). A transient error (MemoryError, EMFILE, EIO, ...) or an unexpected
        one keeps the file and its index entry: a later request may load it."""
        why = f"{type(error).__name__}: {error}"
        with self._lock:
            self._counters.load_failures += 1
            self._counters.misses += 1
            if isinstance(error, FileNotFoundError):
                self._index.drop(name)
                log.warning("disk cache: %s vanished; dropped from the index", name)
            elif isinstance(error, trust.Untrusted):
                self._index.drop(name)  # another user's doing, perhaps: not ours to delete
                log.warning("disk cache: %s is not served: %s", name, error)
            elif isinstance(error, hdr.ForeignRuntime):
                self._index.drop(name)  # another server's valid file: leave it on disk
                log.warning("disk cache: %s is now %s; left on disk, not served", name, error)
            elif isinstance(error, hdr.DiskFormatError):
                self._index.drop(name)
                self._counters.removed += files.remove_bad(
                    self.directory, name, f"cannot load: {why}"
                )
            else:
                log.warning("disk cache: cannot load %s now (%s); the file is kept", name, why)

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
