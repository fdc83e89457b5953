"""The disk tier: checkpoints as files that outlive the process (invariant 8).

One safetensors file per checkpoint (format: `header.py`, `payload.py`), named by
a strong hash of (model key, token ids). `DiskCache` is the tier's one entry point; its
parts: the in-memory index (`index.py`: matching, LRU order, byte budget), rebuilt
by `scan` from file headers alone, the file I/O (`files.py`: atomic writes,
directory survey), what a failed load or save does (`failures.py`) and the counters
(`stats.py`). Tensors are read only by `load`.

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
fit `budget_bytes`. Each access is stamped a later time than the one before it: the
kernel's own file times advance in clock ticks (milliseconds), so two accesses in one
tick would tie and a restart would order them by directory listing. Only files this
process has indexed are counted: two servers sharing a directory each keep their own
view (each enforces the budget on it).

Thread-safety: every public method may be called from any thread; the index is
guarded by one lock. `save` and `load` read and build MLX arrays: call them on the
engine thread (invariant 1). File I/O runs outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mlx_prefix.cache.disk import failures, files, payload, trust
from mlx_prefix.cache.disk import header as hdr
from mlx_prefix.cache.disk.failures import SaveWarnings
from mlx_prefix.cache.disk.files import DiskListing
from mlx_prefix.cache.disk.index import DiskEntry, DiskEntryInfo, DiskIndex, DiskMatch
from mlx_prefix.cache.disk.stats import DiskCounters, DiskStats
from mlx_prefix.cache.snapshot import Snapshot
from mlx_prefix.cache.types import CheckpointKind, StoredTokens, covers

log = logging.getLogger("mlx_prefix.cache.disk")

GiB = 1 << 30
DEFAULT_DISK_BUDGET = 16 * GiB
# Between two access stamps: distinct also as float seconds (DiskEntry.last_access).
_STAMP_STEP_NS = 1000


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
        self._counters = DiskCounters()
        self._save_warnings = SaveWarnings()
        self._last_stamp = 0  # ns: the latest access stamp given (`_stamp`)
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
            if survey.found:  # a later access sorts after these even if the clock went back
                latest = int(survey.found[-1].last_access * 1e9)
                self._last_stamp = max(self._last_stamp, latest)
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
        file (see `failures.load_failed`). Refreshes the entry's recency on success. Call on the
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
            self._save_warnings.saved()
            self._counters.saves += 1
            self._index.drop(name)  # if saved concurrently under the same name
            stamp = self._stamp()
            files.touch(self.directory, name, stamp)
            entry = DiskEntry(
                name,
                model_key,
                self.runtime,
                tokens,
                kind.name,
                snapshot.trimmable,
                enc.size,
                stamp / 1e9,
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
            n, nbytes = len(self._index), self._index.bytes
            return self._counters.stats(str(self.directory), n, nbytes, self.budget_bytes)

    def check_integrity(self) -> None:
        """Assert the index's invariants. Does not mutate."""
        with self._lock:
            self._index.check_integrity(self.budget_bytes)

    # -- internals (with the lock held unless said otherwise) ----------------

    def _touch(self, e: DiskEntry) -> None:
        stamp = self._stamp()
        self._index.touch(e, stamp / 1e9)
        files.touch(self.directory, e.name, stamp)  # recency survives a restart

    def _stamp(self) -> int:
        """An access time in ns after every earlier one of this cache's (mutates)."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + _STAMP_STEP_NS)
        return self._last_stamp

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
        """Count a failed load (takes the lock); `failures.load_failed` says what becomes
        of the file: removed only when proven damaged."""
        with self._lock:
            failures.load_failed(self.directory, self._index, self._counters, name, error)

    def _save_failed(self, message: str, err: int | None) -> bool:
        """Count a failed save; warn once per errno until a save succeeds."""
        with self._lock:
            self._counters.save_failures += 1
            first = self._save_warnings.first(err)
        failures.warn_save(message, err, first)
        return False
