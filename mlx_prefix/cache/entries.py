"""The prompt cache's stored entries: found by tokens, with what each holds and saves.

`EntryTable` keeps the entries by id and, per model key, in a token trie; the buffers
they hold, each counted once (`residency.py`); and for the value policy each entry's
`parent`, its longest stored strict prefix (which would serve instead if it went),
its `saved_work`, the prefill cost (per model key) of the tokens from its parent's end
to its own, and its number of `children` (entries whose parent it is). Parents change
as entries come and go, so adding or removing an entry updates its extensions.

Pure Python (no MLX). Not thread-safe: the store calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_prefix.cache.eviction import Candidate
from mlx_prefix.cache.records import Buffer, CheckpointKind, covers, new_buffer_key
from mlx_prefix.cache.residency import Residency
from mlx_prefix.cache.trie import TokenTrie

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
    saved_work: float  # prefill cost of tokens [base, len(tokens))
    share_bytes: float = 0.0  # its buffers, each split among their holders
    children: int = 0  # entries whose parent it is
    hits: int = 0
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
    ) -> Candidate:
        """How the policy would rank a new entry for `key` (not stored) under `parent`
        (`parent_of(key)`). Does not mutate."""
        work = self.work(model_key, len(parent.tokens) if parent else 0, len(key))
        return Candidate(kind, len(key), work, self.resident.share(buffers, joining=True))

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
        self._reshare(self.resident.add(e.entry_id, buffers))
        return e

    def remove(self, e: Entry) -> None:
        """Forget `e` (mutates): its buffers are freed unless another entry holds them."""
        trie = self.tries[e.model_key]
        for ext in trie.extensions(e.tokens):  # its children go to its parent
            other = self.by_id[ext.value]
            if other.parent is e:
                self._adopt(other, e.parent)
        self._adopt(e, None)
        trie.remove(e.tokens)
        if not len(trie):
            del self.tries[e.model_key]
        del self.by_id[e.entry_id]
        self._reshare(self.resident.remove(e.entry_id, e.buffers))

    def set_cost(self, model_key: str, cost: PrefillCost) -> None:
        """The cost of `model_key`'s entries and of every key it covers (its namespaces)."""
        self._costs[model_key] = cost
        for e in self.by_id.values():
            if covers(model_key, e.model_key):
                self._adopt(e, e.parent)

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
            assert e.saved_work == self.work(e.model_key, e.base, len(e.tokens)), "stale work"
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
        e.saved_work = self.work(e.model_key, e.base, len(e.tokens))

    def _reshare(self, entry_ids: set[int]) -> None:
        for i in entry_ids:
            e = self.by_id.get(i)
            if e is not None:
                e.share_bytes = self.resident.share(e.buffers)
