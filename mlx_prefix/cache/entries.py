"""The prompt cache's stored entries: found by tokens, with what each holds and saves.

`EntryTable` keeps the entries by id and, per model key, in a token trie; the buffers
they hold, each counted once (`eviction/residency.py`); and for the value policy each entry's
`parent`, its longest stored strict prefix, its number of `children` (entries whose
parent it is), and what it saves: `covered`, the tokens of it another stored entry
would serve if it went, and `saved_work`, the prefill cost (per model key) of the rest,
from `covered` to its end. Any stored prefix serves exactly (its parent); a trimmable
entry serves every prefix it shares (invariant 3), so an entry's common prefix with any
other trimmable one is covered too: a dense model's second question on a document
stored beside its first leaves the first saving only its question's tokens. (Raw
common prefixes: the grid point the match aligns down to is a little shorter; the
store does not know the grid.) Entries come and go, so adding or removing one updates
the parents and coverage of the entries sharing a prefix with it. The same rule tells
the store which trimmable entries a new one makes redundant (`outgrown`,
`served_prefixes`).

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_prefix.cache.eviction.policy import Candidate
from mlx_prefix.cache.eviction.residency import Residency
from mlx_prefix.cache.trie import TokenTrie
from mlx_prefix.cache.types import Buffer, CheckpointKind, EntryInfo, covers, new_buffer_key

# Prefill work of tokens [start, end) of a sequence, in any unit (only ratios matter).
PrefillCost = Callable[[int, int], float]


def linear_cost(start: int, end: int) -> float:
    return float(end - start)


@dataclass(slots=True, eq=False)
class Entry:
    entry_id: int
    model_key: str
    tokens: tuple[int, ...]
    payload: Any
    kind: CheckpointKind
    nbytes: int  # all it keeps alive, shared buffers included
    trimmable: bool
    created: float
    last_access: float
    buffers: tuple[Buffer, ...]
    parent: Entry | None  # its longest stored strict prefix
    saved_work: float  # prefill cost of tokens [covered, len(tokens))
    covered: int = 0  # tokens another stored entry serves (>= base)
    share_bytes: float = 0.0  # what removing it frees: its buffers no other entry holds
    children: int = 0  # entries whose parent it is
    hits: int = 0
    uses: int = 0  # requests that restored a prefix of it, its lineage's (eviction/uses.py)
    refs: int = 0  # >0: in use by a running request; never evicted
    pinned: bool = False  # never evicted (the store keeps it in step with its pins)

    @property
    def base(self) -> int:
        """Tokens its parent covers (0: no parent)."""
        return len(self.parent.tokens) if self.parent is not None else 0


def buffers_of(payload: Any) -> tuple[Buffer, ...]:
    """The buffers a payload holds: its `buffers`, or one of its own."""
    nbytes = int(payload.nbytes)
    buffers = tuple(getattr(payload, "buffers", ()) or (Buffer(new_buffer_key(), nbytes),))
    assert sum(b.nbytes for b in buffers) == nbytes, "buffers must sum to nbytes"
    return buffers


class EntryTable:
    def __init__(self) -> None:
        self.by_id: dict[int, Entry] = {}
        self.tries: dict[str, TokenTrie[int]] = {}
        self.resident = Residency()
        self._costs: dict[str, PrefillCost] = {}
        self._trimmable: dict[str, int] = {}  # stored trimmable entries per model key
        self._next_id = 0

    def trie(self, model_key: str) -> TokenTrie[int]:
        """The model key's trie (an empty one if none). Do not mutate it."""
        return self.tries.get(model_key) or TokenTrie()

    def parent_of(self, model_key: str, key: tuple[int, ...]) -> Entry | None:
        """The longest stored strict prefix of `key`. Does not mutate."""
        return self._parent(model_key, key)

    def candidate(
        self,
        model_key: str,
        key: tuple[int, ...],
        kind: CheckpointKind,
        buffers: tuple[Buffer, ...],
        parent: Entry | None,
        uses: int = 0,
    ) -> Candidate:
        """How the policy would rank a new entry for `key` (not stored) under `parent`
        (`parent_of(key)`), its prefix reused `uses` times. Does not mutate."""
        covered = self._covered(model_key, key, len(parent.tokens) if parent else 0)
        work = self.work(model_key, covered, len(key))
        share = self.resident.share(buffers, joining=True)
        return Candidate(kind, len(key), work, share, uses=uses, buffers=buffers)

    def add(
        self,
        model_key: str,
        key: tuple[int, ...],
        payload: Any,
        kind: CheckpointKind,
        buffers: tuple[Buffer, ...],
        now: float,
        parent: Entry | None,
    ) -> Entry:
        """Store a new entry under `parent` (`parent_of(key)`) (mutates); `key` must not
        be stored yet."""
        e = Entry(
            self._next_id, model_key, key, payload, kind, int(payload.nbytes),
            bool(payload.trimmable), now, now, buffers, None, 0.0,
        )  # fmt: skip
        self._next_id += 1
        self._adopt(e, parent)
        trie = self.tries.setdefault(model_key, TokenTrie())
        for ext in trie.extensions(key):  # their parent was `e`'s: now it is `e`
            other = self.by_id[ext.value]
            if other.base < len(key):
                self._adopt(other, e)
        trie.insert(key, e.entry_id)
        self.by_id[e.entry_id] = e
        if e.trimmable:
            self._trimmable[model_key] = self._trimmable.get(model_key, 0) + 1
        self._recover(e)
        if e.trimmable:  # it now serves what it shares with the others
            for other_id, shared in trie.sharing(key):
                other = self.by_id[other_id]
                if shared > other.covered:
                    other.covered = shared
                    other.saved_work = self.work(model_key, shared, len(other.tokens))
        self._reshare(self.resident.add(e.entry_id, buffers))
        return e

    def remove(self, e: Entry) -> None:
        """Forget `e` (mutates): its buffers are freed unless another entry holds them."""
        trie = self.tries[e.model_key]
        served = self._served_by(e, trie) if e.trimmable else []
        children = [self.by_id[x.value] for x in trie.extensions(e.tokens)]
        trie.remove(e.tokens)
        if not len(trie):
            del self.tries[e.model_key]
        del self.by_id[e.entry_id]
        if e.trimmable:
            self._trimmable[e.model_key] -= 1
            if not self._trimmable[e.model_key]:
                del self._trimmable[e.model_key]
        parent = e.parent
        self._adopt(e, None)
        for other in children:  # its children go to its parent
            if other.parent is e:
                self._adopt(other, parent)
        for other in served:
            self._recover(other)
        self._reshare(self.resident.remove(e.entry_id, e.buffers))

    def outgrown(self, model_key: str, key: tuple[int, ...], kind: CheckpointKind) -> bool:
        """Whether a new trimmable entry for `key` would be redundant: a stored trimmable
        entry of same or higher kind extends it, and trimming that one serves it."""
        for ext in self.trie(model_key).extensions(key):
            other = self.by_id[ext.value]
            if other.trimmable and other.kind >= kind:
                return True
        return False

    def served_prefixes(
        self, model_key: str, key: tuple[int, ...], kind: CheckpointKind
    ) -> list[Entry]:
        """The stored trimmable strict prefixes of `key` of no higher kind, neither
        pinned nor locked: a new trimmable entry for `key` serves them by trimming."""
        return [
            other
            for anc in self.trie(model_key).match(key).ancestors
            if anc.length < len(key)
            for other in (self.by_id[anc.value],)
            if other.trimmable and other.kind <= kind and other.refs == 0 and not other.pinned
        ]

    def info(self, e: Entry, now: float) -> EntryInfo:
        """What a listing shows of stored entry `e`. Does not mutate."""
        return EntryInfo(
            entry_id=e.entry_id,
            model_key=e.model_key,
            tokens=len(e.tokens),
            nbytes=e.nbytes,
            kind=e.kind,
            trimmable=e.trimmable,
            hits=e.hits,
            age_s=now - e.created,
            idle_s=now - e.last_access,
            pinned=e.pinned,
            refs=e.refs,
            shared_bytes=self.shared_bytes(e),
        )

    def set_cost(self, model_key: str, cost: PrefillCost) -> None:
        """The cost of `model_key`'s entries and of every key it covers (its namespaces)."""
        self._costs[model_key] = cost
        for e in self.by_id.values():
            if covers(model_key, e.model_key):
                self._recover(e)

    def work(self, key: str, start: int, end: int) -> float:
        cost = self._costs.get(key)
        if cost is None:  # a namespace's key: the cost of the model key covering it
            covering = [k for k in self._costs if covers(k, key)]
            cost = self._costs[max(covering, key=len)] if covering else linear_cost
        return cost(start, end)

    def shared_bytes(self, e: Entry) -> int:
        """Bytes of `e`'s buffers that other entries hold too."""
        return sum(b.nbytes for b in e.buffers if len(self.resident.holders(b.key)) > 1)

    def bytes_by_kind(self) -> dict[str, int]:
        """Resident bytes per kind, each buffer under the highest kind holding it."""
        owner: dict[int, tuple[CheckpointKind, int]] = {}
        for e in self.by_id.values():
            for b in e.buffers:
                if b.key not in owner or e.kind > owner[b.key][0]:
                    owner[b.key] = (e.kind, b.nbytes)
        out = dict.fromkeys((k.name for k in CheckpointKind), 0)
        for kind, nbytes in owner.values():
            out[kind.name] += nbytes
        return out

    def check_integrity(self) -> None:
        self.resident.check_integrity({i: e.buffers for i, e in self.by_id.items()})
        in_tries = 0
        for model_key, trie in self.tries.items():
            trie.check_integrity()
            for item in trie.items():
                e = self.by_id.get(item.value)
                assert e is not None, "trie points at a missing entry"
                assert e.model_key == model_key and e.tokens == item.tokens, "trie/entry key"
                in_tries += 1
        assert in_tries == len(self.by_id), "entries missing from the tries"
        children = dict.fromkeys(self.by_id, 0)
        for e in self.by_id.values():
            assert e.payload.length == len(e.tokens)
            assert e.parent is self._parent(e.model_key, e.tokens), "stale parent"
            covered = self._covered(e.model_key, e.tokens, e.base)
            assert e.covered == covered, "stale coverage"
            assert e.saved_work == self.work(e.model_key, covered, len(e.tokens)), "stale work"
            assert e.share_bytes == self.resident.share(e.buffers), "stale share"
            if e.parent is not None:
                children[e.parent.entry_id] += 1
        assert all(e.children == children[i] for i, e in self.by_id.items()), "children"

    # -- internals --------------------------------------------------------------

    def _parent(self, model_key: str, key: tuple[int, ...]) -> Entry | None:
        ancestors = [a for a in self.trie(model_key).match(key).ancestors if a.length < len(key)]
        return self.by_id[ancestors[-1].value] if ancestors else None

    def _adopt(self, e: Entry, parent: Entry | None) -> None:
        """Make `parent` the parent of `e` (and recompute what `e` saves)."""
        if e.parent is not None:
            e.parent.children -= 1
        e.parent = parent
        if parent is not None:
            parent.children += 1
        if e.entry_id in self.by_id:  # a new entry: `add` recovers it once it is in the trie
            self._recover(e)

    def _covered(self, model_key: str, key: tuple[int, ...], base: int) -> int:
        """Tokens of `key` the stored entries other than its own would serve: its
        longest stored prefix's (`base`), or more, shared with a trimmable entry."""
        if not self._trimmable.get(model_key):
            return base
        shared = (d for i, d in self.trie(model_key).sharing(key) if self.by_id[i].trimmable)
        return max(base, next(shared, 0))  # deepest first: the first shares the most

    def _served_by(self, e: Entry, trie: TokenTrie[int]) -> list[Entry]:
        """The entries whose coverage only `e` (stored, trimmable) gives: they share
        their `covered` tokens with it and with no other trimmable entry. Entries
        sharing d tokens with `e` share at least d with every entry sharing as much."""
        out: list[Entry] = []
        at_least = 0  # trimmable entries sharing at least the current depth with `e`
        group: list[Entry] = []
        depth = None
        for i, d in [*trie.sharing(e.tokens), (None, -1)]:  # deepest first; then a stop
            if d != depth:
                for other in group:
                    if other.covered == depth and at_least - other.trimmable < 1:
                        out.append(other)
                group, depth = [], d
            if i is not None:
                other = self.by_id[i]
                at_least += other.trimmable
                group.append(other)
        return out

    def _recover(self, e: Entry) -> None:
        """Recompute what `e` (stored) saves."""
        e.covered = self._covered(e.model_key, e.tokens, e.base)
        e.saved_work = self.work(e.model_key, e.covered, len(e.tokens))

    def _reshare(self, entry_ids: set[int]) -> None:
        for i in entry_ids:
            e = self.by_id.get(i)
            if e is not None:
                e.share_bytes = self.resident.share(e.buffers)
