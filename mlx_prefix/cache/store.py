"""The prompt cache: checkpoints per model key, longest reuse, one byte budget.

Pure Python (no MLX): payloads are opaque objects with `nbytes`, `trimmable` and
`length` (a `snapshot.Snapshot` in the server, fakes in tests). Thread-safe: every
public method takes the one internal lock (HTTP threads read stats while the
engine thread matches and inserts).

Which entry goes first when over the limits is the eviction policy's choice
(`eviction/policy.py`: KindLRU unless told otherwise, ValueLRU in the engine); lookup is
decided here, insertion, eviction and removal with the lock held in `contents.Contents`
(this class is the locked, public face), what counts against the limits in
`eviction/budget.Budget`, pins and their per-namespace share in `pins.Pins`; the entries
and their bookkeeping (buffers held, each counted once; work each saves) live in
`entries.EntryTable`.

Invariants (checked by `check_integrity`):
- each key has its own trie; a lookup never crosses keys (the model, invariant 7, and
  the namespace, invariant 10, are in the key); listings and flushes select the keys a
  selector `covers`;
- stored bytes + active request bytes <= budget, unless every remaining entry is
  pinned or locked (invariant 6; what counts: `eviction/budget.py`);
- a locked entry (acquired, not yet released) or a pinned one is never evicted;
- one namespace's pinned entries stay within `pin_share` of the budget (`pins.py`);
- a reuse always leaves at least one prompt token to compute (invariant 3).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mlx_prefix.cache.contents import Contents
from mlx_prefix.cache.entries import Entry, PrefillCost, buffers_of
from mlx_prefix.cache.eviction.policy import EvictionPolicy
from mlx_prefix.cache.reuse import best_reuse
from mlx_prefix.cache.token_ids import TokenIds
from mlx_prefix.cache.types import (
    Buffer,
    CacheMatch,
    CacheStats,
    CheckpointKind,
    EntryInfo,
    EvictOutcome,
    StoredTokens,
    covers,
)


class PromptCache:
    def __init__(
        self,
        budget_bytes: int,
        max_entries: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        policy: EvictionPolicy[Entry] | None = None,
        pin_share: float = 1.0,
    ) -> None:
        assert budget_bytes >= 0 and 0.0 <= pin_share <= 1.0
        self._lock = threading.Lock()
        self._contents = Contents(budget_bytes, max_entries, clock, policy, pin_share)
        self._entries = self._contents.entries  # read-only alias: the table mutates it
        # What eviction took (and inserts refused for room): why a later request missed.
        self.evicted = self._contents.evicted

    @property
    def budget_bytes(self) -> int:
        return self._contents.budget.nbytes

    @property
    def pin_share(self) -> float:
        """Of the budget, what one namespace may pin."""
        return self._contents.pins.share

    @pin_share.setter
    def pin_share(self, share: float) -> None:
        self._contents.pins.share = share

    # -- lookup ------------------------------------------------------------

    def match(
        self,
        model_key: str,
        tokens: Sequence[int],
        align: Callable[[int], int],
        *,
        record: bool = True,
    ) -> CacheMatch:
        """Find the entry giving the longest reuse for `tokens` (invariant 3).

        `align(n)` is the largest grid position <= n. Trimmable entries reuse their
        common prefix with `tokens`, aligned and capped at len(tokens) - 1;
        non-trimmable entries only when their whole sequence is a prefix of
        `tokens`, at most len(tokens) - 1 long, and on the grid. Counts a hit or a
        miss unless `record` is False (a scheduler's peek); does not lock or refresh
        the entry (`acquire` does).
        """
        with self._lock:
            trie = self._contents.table.trie(model_key)
            found = best_reuse(trie, tokens, align, lambda i: self._entries[i].trimmable)
            if found.value is None:
                self._contents.counters.misses += record
                return CacheMatch(None, 0, 0, found.matched_tokens)
            self._contents.counters.hits += record
            self._contents.counters.tokens_reused += found.reuse_tokens if record else 0
            if record:  # one more use of the prefix: the value policy's frequency
                ids = tokens if isinstance(tokens, TokenIds) else TokenIds(tokens)
                self._contents.restored(
                    model_key, ids, found.reuse_tokens, self._entries[found.value]
                )
            kind = self._entries[found.value].kind
            return CacheMatch(
                found.value, found.reuse_tokens, found.trim, found.matched_tokens, kind
            )

    def get(self, model_key: str, tokens: Sequence[int]) -> Any | None:
        """The payload stored under exactly `tokens`, or None. Does not mutate: no lock
        against eviction, no recency refresh, no hit counted (payloads are immutable, so
        a caller may keep it past an eviction)."""
        with self._lock:
            entry_id = self._contents.table.trie(model_key).get(tokens)
            return self._entries[entry_id].payload if entry_id is not None else None

    def acquire(self, entry_id: int) -> Any | None:
        """Lock the entry against eviction and mark it most recently used (mutates).

        Returns its payload, or None if it was removed since `match` (a concurrent
        `clear`): the caller treats that as a miss. Pair with `release`.
        """
        with self._lock:
            e = self._entries.get(entry_id)
            if e is None:
                return None
            e.refs += 1
            e.hits += 1
            self._contents.touch(e)
            return e.payload

    def hand_over(
        self,
        entry_id: int,
        need: Callable[[Any], int | None],
        keeps: Callable[[Any], int] | None = None,
    ) -> Any | None:
        """The payload of the entry a request is about to restore and extend, removed from
        the store, when the budget cannot hold it beside the `need(payload)` bytes the
        request will hold besides (its live cache copies the entry's tokens: two copies of
        one KV; `need` None: this payload is never handed over). The request's cache then
        carries those tokens, and its end stores the longer entry in its place; nothing
        else is evicted to keep a second copy, and nothing is evicted and then refused.
        `keeps(payload)`: the bytes the request's cache holds at its end, when they must
        fit beside what stays once the entry is gone (a next-turn prefetch, whose end is
        stored from its cache: one that could not store it would lose the entry).
        None: it fits (or the entry is pinned, locked or gone; or its end would not fit),
        and the caller `acquire`s it as usual. Counted as a hit by the caller's `match`."""
        with self._lock:
            e = self._entries.get(entry_id)
            if e is None or (n := need(e.payload)) is None:
                return None
            after = keeps(e.payload) if keeps is not None else None
            if not self._contents.hand_over(e, n, after):
                return None
            e.hits += 1
            return e.payload

    def has_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit beside what is stored and running, evicting nothing.
        Does not mutate."""
        with self._lock:
            return self._contents.budget.used() + nbytes <= self._contents.budget.nbytes

    def could_hold(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit beside running requests and the entries eviction
        cannot take (pinned, locked), evicting the rest. Does not mutate."""
        with self._lock:
            return self._contents.budget.fixed() + nbytes <= self._contents.budget.nbytes

    def release(self, entry_id: int) -> None:
        """Drop one lock taken by `acquire` (mutates); may evict if over budget."""
        with self._lock:
            e = self._entries.get(entry_id)
            assert e is not None and e.refs > 0, f"release of unlocked entry {entry_id}"
            e.refs -= 1
            self._contents.evict()

    # -- mutation ----------------------------------------------------------

    def insert(
        self, model_key: str, tokens: Sequence[int], payload: Any, kind: CheckpointKind
    ) -> bool:
        """Store a checkpoint of `tokens` (mutates); evicts to stay within budget.

        Returns False, changing nothing, when it is not stored: it would not fit even
        after evicting every entry allowed to go before it (lower or same kind, not
        pinned, not locked), or it is redundant (a trimmable entry that is a strict
        prefix of a trimmable entry of same or higher kind). An exact duplicate
        refreshes the stored entry (its recency, and its kind if `kind` is higher) and
        keeps the stored payload.
        A trimmable insert drops stored trimmable strict prefixes of no higher kind
        that are neither pinned nor locked: trimming the new entry serves them.
        """
        key = TokenIds(tokens)  # packed once for the trie walks below
        if payload.length != len(key):
            raise ValueError(f"payload length {payload.length} != {len(key)} tokens")
        with self._lock:
            return self._contents.insert(model_key, key, payload, kind, buffers_of(payload))

    def pin(self, model_key: str, tokens: Sequence[int]) -> bool:
        """Never evict (or drop as redundant) the entry for exactly `tokens` (mutates).

        The pin is kept by key, so it also covers an entry inserted later (unless that
        entry would take its namespace past its share). Returns whether such an entry is
        stored now. Raises PinQuotaExceeded, changing nothing, when pinning the stored
        entry would take its namespace past its share of the budget.
        """
        key = tuple(tokens)
        with self._lock:
            e = self._contents.stored(model_key, key)
            self._contents.pins.pin(model_key, key, e, self.budget_bytes)
            return e is not None

    def pin_stored(self, model_key: str, sequences: Sequence[Sequence[int]]) -> int:
        """Pin the stored entries of exactly these sequences, all or none (mutates);
        sequences with no entry get no pin. Returns how many entries are pinned. Raises
        PinQuotaExceeded, changing nothing, when they would take the namespace past its
        share of the budget."""
        with self._lock:
            trie = self._contents.table.trie(model_key)
            ids = {i for s in sequences if (i := trie.get(tuple(s))) is not None}
            entries = [self._entries[i] for i in sorted(ids)]
            self._contents.pins.pin_entries(entries, self.budget_bytes)
            return len(entries)

    def unpin(self, model_key: str, tokens: Sequence[int]) -> bool:
        """Remove a pin (mutates); may evict. Returns whether it was pinned."""
        key = tuple(tokens)
        with self._lock:
            if not self._contents.pins.unpin(model_key, key, self._contents.stored(model_key, key)):
                return False
            self._contents.evict()
            return True

    def set_pinned(self, model_key: str, entry_id: int, pinned: bool) -> bool:
        """`pin` or `unpin` the sequence of entry `entry_id` (mutates; unpinning may evict).
        Returns False, changing nothing, when no such entry of a key `model_key` covers
        is stored; raises PinQuotaExceeded as `pin` does."""
        with self._lock:
            e = self._entries.get(entry_id)
            if e is None or not covers(model_key, e.model_key):
                return False
            self._contents.pins.set(e, pinned, self.budget_bytes)
            if not pinned:
                self._contents.evict()
            return True

    def evict_entry(self, model_key: str, entry_id: int) -> EvictOutcome:
        """Remove one entry of a key `model_key` covers now (mutates), unless a running
        request holds it or it is pinned (unpin it first). Not counted in `evictions`,
        like `clear`."""
        with self._lock:
            e = self._entries.get(entry_id)
            if e is None or not covers(model_key, e.model_key):
                return EvictOutcome.MISSING
            if e.refs > 0:
                return EvictOutcome.LOCKED
            if e.pinned:
                return EvictOutcome.PINNED
            self._contents.remove(e)
            return EvictOutcome.EVICTED

    def set_active_bytes(self, request_id: str, nbytes: int, shared: Sequence[Buffer] = ()) -> None:
        """Report a running request's cache size (mutates); evicts to make room.

        `shared`: buffers among those `nbytes` that stored entries may hold too (views
        of the live cache a stored snapshot keeps); each counts once, as an entry's
        while one holds it, else as the request's. ValueError if they exceed `nbytes`."""
        assert nbytes >= 0
        with self._lock:
            self._contents.budget.active.set(request_id, nbytes, shared)
            self._contents.evict()

    def drop_active(self, request_id: str) -> None:
        """Forget a finished request's bytes (mutates). Unknown ids are ignored."""
        with self._lock:
            self._contents.budget.active.drop(request_id)

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget (mutates); evicts down to it."""
        assert budget_bytes >= 0
        with self._lock:
            self._contents.budget.nbytes = budget_bytes
            self._contents.evict()

    def set_prefill_cost(self, model_key: str, cost: PrefillCost) -> None:
        """How much prefill work tokens [start, end) of `model_key`'s sequences take
        (mutates; default: one unit per token). The value policy ranks entries by it."""
        with self._lock:
            self._contents.table.set_cost(model_key, cost)

    def clear(self, model_key: str | None = None) -> int:
        """Remove every entry (of the keys `model_key` covers, or all), pinned ones and
        their pins included; locked entries stay (a running request counts on them).
        Mutates. Returns the number removed."""

        def chosen(key: str) -> bool:
            return model_key is None or covers(model_key, key)

        with self._lock:
            victims = [e for e in self._entries.values() if chosen(e.model_key) and e.refs == 0]
            for e in victims:
                self._contents.remove(e)
            self._contents.pins.clear(chosen)  # the locked entries left lose their pins too
            return len(victims)

    # -- introspection -----------------------------------------------------

    def stats(self) -> CacheStats:
        """A consistent snapshot of the counters. Does not mutate."""
        with self._lock:
            return self._contents.counters.stats(self._contents.table, self._contents.budget)

    def entries(self) -> list[EntryInfo]:
        """All entries in eviction order (first listed goes first). Does not mutate."""
        with self._lock:
            now = self._contents.clock()
            return [self._contents.table.info(e, now) for e in self._contents.policy.order()]

    def sequences(self, model_key: str) -> list[StoredTokens[EntryInfo]]:
        """The entries of the keys `model_key` covers, with the token ids each holds, in
        eviction order. Does not mutate; holds the lock only to copy references (token
        tuples are immutable, and no payload is touched)."""
        with self._lock:
            now = self._contents.clock()
            return [
                StoredTokens(self._contents.table.info(e, now), e.tokens)
                for e in self._contents.policy.order()
                if covers(model_key, e.model_key)
            ]

    def check_integrity(self) -> None:
        """Assert the store's invariants. Does not mutate."""
        with self._lock:
            self._contents.check_integrity()
