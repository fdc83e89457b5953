"""The prompt cache: checkpoints per model key, longest reuse, one byte budget.

Pure Python (no MLX): payloads are opaque objects with `nbytes`, `trimmable` and
`length` (a `snapshot.Snapshot` in the server, fakes in tests). Thread-safe: every
public method takes the one internal lock (HTTP threads read stats while the
engine thread matches and inserts).

Which entry goes first when over the limits is the eviction policy's choice
(`eviction.py`: KindLRU unless told otherwise, ValueLRU in the engine); lookup,
insertion, pins and the budget are decided here; the entries and their bookkeeping
(buffers held, each counted once; work each saves) live in `entries.EntryTable`.

Invariants (checked by `check_integrity`):
- each key has its own trie; a lookup never crosses keys (the model, invariant 7, and
  the namespace, invariant 10, are in the key); listings and flushes select the keys a
  selector `covers`;
- stored bytes (distinct buffers: one prefill's checkpoints share its KV) + active
  request bytes (less the buffers they share with stored entries: `active.py`) <=
  budget, unless every remaining entry is pinned or locked (invariant 6);
- a locked entry (acquired, not yet released) or a pinned one is never evicted;
- one namespace's pinned entries (its distinct buffers, over every model) stay within
  `pin_share` of the budget: a pin past it is refused (PinQuotaExceeded), so one client
  cannot pin the budget full and leave no room for anyone else's inserts;
- a reuse always leaves at least one prompt token to compute (invariant 3).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_prefix.cache.active import ActiveBytes
from mlx_prefix.cache.entries import Entry, EntryTable, PrefillCost, buffers_of
from mlx_prefix.cache.eviction import Candidate, EvictionPolicy, KindLRU
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
from mlx_prefix.errors import PinQuotaExceeded


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0


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
        self.budget_bytes = budget_bytes
        self.pin_share = pin_share  # of the budget, what one namespace may pin
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._table = EntryTable()
        self._entries = self._table.by_id  # read-only alias: the table mutates it
        self._policy: EvictionPolicy[Entry] = policy if policy is not None else KindLRU()
        self._pins: set[tuple[str, tuple[int, ...]]] = set()
        self._active = ActiveBytes()
        self._counters = _Counters()

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
            trie = self._table.trie(model_key)
            found = best_reuse(trie, tokens, align, lambda i: self._entries[i].trimmable)
            if found.value is None:
                self._counters.misses += record
                return CacheMatch(None, 0, 0, found.matched_tokens)
            self._counters.hits += record
            self._counters.tokens_reused += found.reuse_tokens if record else 0
            return CacheMatch(found.value, found.reuse_tokens, found.trim, found.matched_tokens)

    def get(self, model_key: str, tokens: Sequence[int]) -> Any | None:
        """The payload stored under exactly `tokens`, or None. Does not mutate: no lock
        against eviction, no recency refresh, no hit counted (payloads are immutable, so
        a caller may keep it past an eviction)."""
        with self._lock:
            entry_id = self._table.trie(model_key).get(tokens)
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
            self._touch(e)
            return e.payload

    def release(self, entry_id: int) -> None:
        """Drop one lock taken by `acquire` (mutates); may evict if over budget."""
        with self._lock:
            e = self._entries.get(entry_id)
            assert e is not None and e.refs > 0, f"release of unlocked entry {entry_id}"
            e.refs -= 1
            self._evict()

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
            buffers = buffers_of(payload)
            trie = self._table.trie(model_key)
            dup = trie.get(key)
            if dup is not None:
                e = self._entries[dup]
                if kind > e.kind:
                    old, e.kind = e.kind, kind
                    self._policy.change_kind(e, old)
                self._touch(e)
                return True
            trimmable = bool(payload.trimmable)
            redundant: list[Entry] = []
            if trimmable and (model_key, key) not in self._pins:
                for ext in trie.extensions(key):
                    other = self._entries[ext.value]
                    if other.trimmable and other.kind >= kind:
                        return False
            if trimmable:
                redundant = [
                    other
                    for anc in trie.match(key).ancestors
                    if anc.length < len(key)
                    for other in (self._entries[anc.value],)
                    if other.trimmable
                    and other.kind <= kind
                    and other.refs == 0
                    and not self._pinned(other)
                ]
            # Decide before changing anything: a refused insert must not have dropped the
            # prefixes it would have made redundant, nor evicted entries to no avail.
            parent = self._table.parent_of(model_key, key)
            new = self._table.candidate(model_key, key, kind, buffers, parent)
            if not self._fits(new, buffers, redundant):
                return False
            e = self._table.add(model_key, key, payload, kind, buffers, self._clock(), parent)
            if (model_key, key) in self._pins:  # a pin that came before its entry
                if self._pin_overflow([e]) is None:
                    e.pinned = True
                else:
                    self._pins.discard((model_key, key))
            self._policy.add(e)
            for other in redundant:  # after the insert: the trie never empties on the way
                self._remove(other)
            # It fits: what stays besides it (pinned, locked) leaves room. Held while
            # evicting, since a value policy's ranks move as entries go.
            e.refs += 1
            self._evict()
            e.refs -= 1
            assert not self._over_limits() or self._victim() is None, "over budget"
            return True

    def pin(self, model_key: str, tokens: Sequence[int]) -> bool:
        """Never evict (or drop as redundant) the entry for exactly `tokens` (mutates).

        The pin is kept by key, so it also covers an entry inserted later (unless that
        entry would take its namespace past its share). Returns whether such an entry is
        stored now. Raises PinQuotaExceeded, changing nothing, when pinning the stored
        entry would take its namespace past its share of the budget.
        """
        key = tuple(tokens)
        with self._lock:
            entry_id = self._table.trie(model_key).get(key)
            if entry_id is not None:
                self._refuse_over_share([self._entries[entry_id]])
                self._entries[entry_id].pinned = True
            self._pins.add((model_key, key))
            return entry_id is not None

    def pin_stored(self, model_key: str, sequences: Sequence[Sequence[int]]) -> int:
        """Pin the stored entries of exactly these sequences, all or none (mutates);
        sequences with no entry get no pin. Returns how many entries are pinned. Raises
        PinQuotaExceeded, changing nothing, when they would take the namespace past its
        share of the budget."""
        with self._lock:
            trie = self._table.trie(model_key)
            ids = {i for s in sequences if (i := trie.get(tuple(s))) is not None}
            entries = [self._entries[i] for i in sorted(ids)]
            self._refuse_over_share(entries)
            for e in entries:
                e.pinned = True
                self._pins.add((e.model_key, e.tokens))
            return len(entries)

    def unpin(self, model_key: str, tokens: Sequence[int]) -> bool:
        """Remove a pin (mutates); may evict. Returns whether it was pinned."""
        key = tuple(tokens)
        with self._lock:
            try:
                self._pins.remove((model_key, key))
            except KeyError:
                return False
            entry_id = self._table.trie(model_key).get(tokens)
            if entry_id is not None:
                self._entries[entry_id].pinned = False
            self._evict()
            return True

    def set_pinned(self, model_key: str, entry_id: int, pinned: bool) -> bool:
        """`pin` or `unpin` the sequence of entry `entry_id` (mutates; unpinning may evict).
        Returns False, changing nothing, when no such entry of a key `model_key` covers
        is stored; raises PinQuotaExceeded as `pin` does."""
        with self._lock:
            e = self._entries.get(entry_id)
            if e is None or not covers(model_key, e.model_key):
                return False
            if pinned:
                self._refuse_over_share([e])
            e.pinned = pinned
            if pinned:
                self._pins.add((e.model_key, e.tokens))
            else:
                self._pins.discard((e.model_key, e.tokens))
                self._evict()
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
            if self._pinned(e):
                return EvictOutcome.PINNED
            self._remove(e)
            return EvictOutcome.EVICTED

    def set_active_bytes(self, request_id: str, nbytes: int, shared: Sequence[Buffer] = ()) -> None:
        """Report a running request's cache size (mutates); evicts to make room.

        `shared`: buffers among those `nbytes` that stored entries may hold too (views
        of the live cache a stored snapshot keeps); each counts once, as an entry's
        while one holds it, else as the request's. ValueError if they exceed `nbytes`."""
        assert nbytes >= 0
        with self._lock:
            self._active.set(request_id, nbytes, shared)
            self._evict()

    def drop_active(self, request_id: str) -> None:
        """Forget a finished request's bytes (mutates). Unknown ids are ignored."""
        with self._lock:
            self._active.drop(request_id)

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget (mutates); evicts down to it."""
        assert budget_bytes >= 0
        with self._lock:
            self.budget_bytes = budget_bytes
            self._evict()

    def set_prefill_cost(self, model_key: str, cost: PrefillCost) -> None:
        """How much prefill work tokens [start, end) of `model_key`'s sequences take
        (mutates; default: one unit per token). The value policy ranks entries by it."""
        with self._lock:
            self._table.set_cost(model_key, cost)

    def clear(self, model_key: str | None = None) -> int:
        """Remove every entry (of the keys `model_key` covers, or all), pinned ones and
        their pins included; locked entries stay (a running request counts on them).
        Mutates. Returns the number removed."""

        def chosen(key: str) -> bool:
            return model_key is None or covers(model_key, key)

        with self._lock:
            victims = [e for e in self._entries.values() if chosen(e.model_key) and e.refs == 0]
            for e in victims:
                self._remove(e)
            self._pins = {p for p in self._pins if not chosen(p[0])}
            for e in self._entries.values():  # the locked ones left
                e.pinned = e.pinned and not chosen(e.model_key)
            return len(victims)

    # -- introspection -----------------------------------------------------

    def stats(self) -> CacheStats:
        """A consistent snapshot of the counters. Does not mutate."""
        with self._lock:
            counts = dict.fromkeys((k.name for k in CheckpointKind), 0)
            for e in self._entries.values():
                counts[e.kind.name] += 1
            c = self._counters
            return CacheStats(
                hits=c.hits,
                misses=c.misses,
                tokens_reused=c.tokens_reused,
                entries=len(self._entries),
                bytes=self._table.resident.total,
                bytes_by_kind=self._table.bytes_by_kind(),
                entries_by_kind=counts,
                active_bytes=self._active_bytes(),
                active_requests=len(self._active),
                evictions=c.evictions,
                budget_bytes=self.budget_bytes,
                pinned=sum(1 for e in self._entries.values() if self._pinned(e)),
                locked=sum(1 for e in self._entries.values() if e.refs > 0),
            )

    def entries(self) -> list[EntryInfo]:
        """All entries in eviction order (first listed goes first). Does not mutate."""
        with self._lock:
            now = self._clock()
            return [self._info(e, now) for e in self._policy.order()]

    def sequences(self, model_key: str) -> list[StoredTokens[EntryInfo]]:
        """The entries of the keys `model_key` covers, with the token ids each holds, in
        eviction order. Does not mutate; holds the lock only to copy references (token
        tuples are immutable, and no payload is touched)."""
        with self._lock:
            now = self._clock()
            return [
                StoredTokens(self._info(e, now), e.tokens)
                for e in self._policy.order()
                if covers(model_key, e.model_key)
            ]

    def check_integrity(self) -> None:
        """Assert the store's invariants. Does not mutate."""
        with self._lock:
            self._active.check_integrity()
            self._table.check_integrity()
            self._policy.check_integrity(self._entries)
            for e in self._entries.values():
                assert e.refs >= 0 and e.nbytes >= 0
                assert e.payload.length == len(e.tokens)
                assert e.pinned == ((e.model_key, e.tokens) in self._pins), "pin flag"
            if self._over_limits():
                assert self._victim() is None, "over budget with evictable entries left"

    # -- internals (call with the lock held) --------------------------------

    def _info(self, e: Entry, now: float) -> EntryInfo:
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
            pinned=self._pinned(e),
            refs=e.refs,
            shared_bytes=self._table.shared_bytes(e),
        )

    def _touch(self, e: Entry) -> None:
        e.last_access = self._clock()
        self._policy.touch(e)

    def _pinned(self, e: Entry) -> bool:
        # The flag, not a lookup in _pins: hashing a long token tuple per entry, on every
        # listing and eviction check, held the lock for ~50 ms at 500 entries of 5K tokens.
        return e.pinned

    def _pin_overflow(self, adding: list[Entry]) -> tuple[int, int] | None:
        """(bytes its namespace would have pinned, its share) if pinning `adding` (one
        namespace's entries) would go past the share; None if it fits."""
        if not adding:
            return None
        owner = _namespace(adding[0].model_key)
        held: dict[int, int] = {}
        for e in self._entries.values():
            if e.pinned and _namespace(e.model_key) == owner:
                held.update((b.key, b.nbytes) for b in e.buffers)
        for e in adding:
            held.update((b.key, b.nbytes) for b in e.buffers)
        total, share = sum(held.values()), int(self.pin_share * self.budget_bytes)
        return (total, share) if total > share else None

    def _refuse_over_share(self, adding: list[Entry]) -> None:
        over = self._pin_overflow(adding)
        if over is not None:
            raise PinQuotaExceeded(
                f"pinning this would hold {over[0]} bytes pinned for this client, more than "
                f"its share of the cache ({over[1]} bytes: --pin-share {self.pin_share:g} of "
                f"the {self.budget_bytes}-byte budget); unpin entries first"
            )

    def _active_bytes(self) -> int:
        return self._active.total(self._table.resident.holds)

    def _over_limits(self) -> bool:
        if self._table.resident.total + self._active_bytes() > self.budget_bytes:
            return True
        return self.max_entries is not None and len(self._entries) > self.max_entries

    def _fits(self, new: Candidate, buffers: tuple[Buffer, ...], leaving: list[Entry]) -> bool:
        """Whether `new`, holding `buffers`, would survive eviction once the `leaving`
        entries are gone: what stays is what the policy evicts after it, plus the
        pinned and locked entries (buffers they share with it, or with running
        requests, count once)."""
        gone = {e.entry_id for e in leaving}
        outlasting = self._policy.outlasting(new)
        kept = [
            e
            for e in self._entries.values()
            if e.entry_id not in gone
            and (e.refs > 0 or self._pinned(e) or e.entry_id in outlasting)
        ]
        groups = [buffers, *(e.buffers for e in kept), self._active.shared()]
        kept_bytes = self._table.resident.union(groups)
        if kept_bytes + self._active.own_total > self.budget_bytes:
            return False
        return self.max_entries is None or len(kept) + 1 <= self.max_entries

    def _victim(self) -> Entry | None:
        return next((e for e in self._policy.order() if e.refs == 0 and not self._pinned(e)), None)

    def _evict(self) -> None:
        while self._over_limits():
            victim = self._victim()
            if victim is None:
                return  # everything left is pinned or in use
            self._remove(victim)
            self._counters.evictions += 1

    def _remove(self, e: Entry) -> None:
        assert e.refs == 0, "removing a locked entry"
        self._policy.remove(e)
        self._table.remove(e)


def _namespace(key: str) -> str:
    """Whose pins an entry's are: the namespace part of its key (engine/keys.py:
    `<model>/<namespace>[/<salt>]`), the same for every model; a key without one is its
    own owner."""
    parts = key.split("/")
    return parts[1] if len(parts) > 1 else key
