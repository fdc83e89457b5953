"""The disk tier's index: the checkpoint files it knows, held in memory (invariant 8).

Rebuilt by a scan from file headers (`files.survey`), then kept up to date by
saves, loads and removals. Matching uses a token trie per (model key, runtime) and
the reuse rules (`reuse`); the byte budget uses one LRU order across every file
(access = save or load). Files of other model keys or runtimes are indexed and count
against the budget, but never match.

Not thread-safe: the owner (`disk.DiskCache`) holds its lock around every call. The
index touches no file: what it drops, the owner removes from the directory.
Pure Python (no MLX).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mlx_prefix.cache.disk.header import entry_name
from mlx_prefix.cache.reuse import best_reuse
from mlx_prefix.cache.trie import TokenTrie
from mlx_prefix.cache.types import CheckpointKind

HISTORY = CheckpointKind.HISTORY


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


@dataclass(slots=True, eq=False)
class DiskEntry:
    name: str
    model_key: str
    runtime: str
    tokens: tuple[int, ...]
    kind: str
    trimmable: bool
    nbytes: int
    last_access: float  # time.time()

    def info(self, now: float) -> DiskEntryInfo:
        return DiskEntryInfo(
            self.name,
            self.model_key,
            self.runtime,
            len(self.tokens),
            self.kind,
            self.trimmable,
            self.nbytes,
            max(0.0, now - self.last_access),
        )


class DiskIndex:
    def __init__(self, runtime: str) -> None:
        self.runtime = runtime  # only files written by this runtime match
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()  # least recently used first
        self._tries: dict[tuple[str, str], TokenTrie[DiskEntry]] = {}  # (model key, runtime)
        self.bytes = 0  # total size of the indexed files

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> DiskEntry | None:
        return self._entries.get(name)

    def entries(self) -> Iterable[DiskEntry]:
        """Every indexed entry, least recently used first. Does not mutate."""
        return self._entries.values()

    # -- mutation -------------------------------------------------------------

    def reset(self, found: Iterable[DiskEntry]) -> None:
        """Forget everything, then index `found` (least recently used first)."""
        self._entries.clear()
        self._tries.clear()
        self.bytes = 0
        for e in found:
            self.add(e)

    def add(self, e: DiskEntry) -> None:
        """Index `e` as the most recently used entry; its name must be new."""
        self._entries[e.name] = e
        self._tries.setdefault((e.model_key, e.runtime), TokenTrie()).insert(e.tokens, e)
        self.bytes += e.nbytes

    def drop(self, name: str) -> DiskEntry | None:
        """Forget the entry called `name`, if indexed; returns it."""
        e = self._entries.pop(name, None)
        if e is None:
            return None
        key = (e.model_key, e.runtime)
        trie = self._tries[key]
        trie.remove(e.tokens)
        if not len(trie):
            del self._tries[key]
        self.bytes -= e.nbytes
        return e

    def touch(self, e: DiskEntry) -> None:
        """Mark `e` the most recently used (in memory; the owner sets the file's mtime)."""
        e.last_access = time.time()
        self._entries.move_to_end(e.name)

    def evict(self, budget_bytes: int | None, keep: str | None) -> list[DiskEntry]:
        """Drop least recently used entries, never `keep`, until the indexed bytes fit
        `budget_bytes` (None: no limit) or only `keep` is left. Returns what it dropped."""
        dropped: list[DiskEntry] = []
        while budget_bytes is not None and self.bytes > budget_bytes:
            victim = next((e for e in self._entries.values() if e.name != keep), None)
            if victim is None:
                break
            self.drop(victim.name)
            dropped.append(victim)
        return dropped

    # -- lookup ---------------------------------------------------------------

    def best(
        self, model_key: str, tokens: Sequence[int], align: Callable[[int], int]
    ) -> DiskMatch | None:
        """The entry of `model_key` and this runtime giving the longest reuse for
        `tokens` (`reuse.best_reuse`), or None. Does not mutate."""
        trie = self._tries.get((model_key, self.runtime))
        if trie is None:
            return None
        found = best_reuse(trie, tokens, align, lambda e: e.trimmable)
        e = found.value
        if e is None:
            return None
        kind = CheckpointKind[e.kind] if e.kind in CheckpointKind.__members__ else HISTORY
        return DiskMatch(
            e.name,
            e.model_key,
            e.tokens,
            found.reuse_tokens,
            found.trim,
            found.matched_tokens,
            e.nbytes,
            kind,
        )

    def covering(
        self, name: str, model_key: str, tokens: tuple[int, ...], trimmable: bool
    ) -> DiskEntry | None:
        """The entry that makes a save of `tokens` (file `name`) redundant: the same
        checkpoint, or for a trimmable one a trimmable extension. Does not mutate."""
        e = self._entries.get(name)
        if e is None and trimmable:
            trie = self._tries.get((model_key, self.runtime))
            if trie is not None:
                e = next((x.value for x in trie.extensions(tokens) if x.value.trimmable), None)
        return e

    def served_prefixes(self, e: DiskEntry) -> list[DiskEntry]:
        """Trimmable entries that are strict prefixes of the trimmable `e`: restoring `e`
        with a trim serves them. Does not mutate."""
        trie = self._tries[(e.model_key, e.runtime)]
        return [
            anc.value
            for anc in trie.match(e.tokens).ancestors
            if anc.value is not e and anc.value.trimmable
        ]

    def check_integrity(self, budget_bytes: int | None) -> None:
        """Assert the index's invariants. Does not mutate."""
        assert self.bytes == sum(e.nbytes for e in self._entries.values()), "byte total"
        limit = budget_bytes
        assert limit is None or self.bytes <= limit or len(self._entries) <= 1, "budget"
        count = 0
        for (model_key, runtime), trie in self._tries.items():
            trie.check_integrity()
            assert len(trie), "empty trie kept"
            for item in trie.items():
                e = item.value
                assert self._entries.get(e.name) is e, "trie points at a dropped entry"
                assert (e.model_key, e.runtime, e.tokens) == (model_key, runtime, item.tokens)
                assert entry_name(e.model_key, e.tokens) == e.name, "name/key"
                count += 1
        assert count == len(self._entries), "entries missing from the tries"
