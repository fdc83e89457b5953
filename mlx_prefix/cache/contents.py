"""What the prompt cache holds and the rules that change it, with the store's lock held.

`store.PromptCache` is the thread-safe face: every public method takes its one lock and
calls in here. Here are the parts (the entry table, the eviction policy, the budget, the
pins, the counters, the eviction log) and the steps that keep them consistent: an
insertion decided whole before anything changes, eviction down to the budget, removal,
and the integrity check of the store's invariants (listed in `store.py`).

Pure Python (no MLX). Not thread-safe: call with the store's lock held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_prefix.cache.counters import Counters
from mlx_prefix.cache.entries import Entry, EntryTable
from mlx_prefix.cache.eviction.budget import Budget
from mlx_prefix.cache.eviction.log import EvictionLog
from mlx_prefix.cache.eviction.policy import EvictionPolicy, KindLRU
from mlx_prefix.cache.eviction.uses import INHERIT_SHARE, Lineage
from mlx_prefix.cache.pins import Pins
from mlx_prefix.cache.token_ids import TokenIds
from mlx_prefix.cache.types import Buffer, CheckpointKind


class Contents:
    def __init__(
        self,
        budget_bytes: int,
        max_entries: int | None,
        clock: Callable[[], float],
        policy: EvictionPolicy[Entry] | None,
        pin_share: float,
    ) -> None:
        self.clock = clock
        self.table = EntryTable()
        self.entries = self.table.by_id  # read-only alias: the table mutates it
        self.policy: EvictionPolicy[Entry] = policy if policy is not None else KindLRU()
        self.budget = Budget(budget_bytes, max_entries, self.table, self.policy)
        self.pins = Pins(pin_share, self.entries)
        self.counters = Counters()
        # What eviction took (and inserts refused for room): why a later request missed.
        self.evicted = EvictionLog()
        self.lineage = Lineage()  # how often each restored prefix was reused

    def insert(
        self,
        model_key: str,
        key: TokenIds,
        payload: Any,
        kind: CheckpointKind,
        buffers: tuple[Buffer, ...],
    ) -> bool:
        """`PromptCache.insert` once its lock is held: whether `key` is stored (or was)."""
        trie = self.table.trie(model_key)
        dup = trie.get(key)
        if dup is not None:
            e = self.entries[dup]
            if kind > e.kind:
                old, e.kind = e.kind, kind
                self.policy.change_kind(e, old)
            self.touch(e)
            return True
        redundant: list[Entry] = []
        if payload.trimmable:
            pinned = (model_key, key) in self.pins
            if not pinned and self.table.outgrown(model_key, key, kind):
                return False
            redundant = self.table.served_prefixes(model_key, key, kind)
        # Decide before changing anything: a refused insert must not have dropped the
        # prefixes it would have made redundant, nor evicted entries to no avail.
        parent = self.table.parent_of(model_key, key)
        uses = self.lineage.inherited(model_key, key)
        new = self.table.candidate(model_key, key, kind, buffers, parent, uses)
        if short := self.budget.shortfall(new, buffers, redundant):
            trimmable, nbytes = payload.trimmable, payload.nbytes
            self.evicted.add(model_key, key, trimmable, nbytes, short, refused=True)
            return False
        e = self.table.add(model_key, key, payload, kind, buffers, self.clock(), parent)
        e.uses = uses
        self.pins.adopt(e, self.budget.nbytes)  # a pin that came before its entry
        self.policy.add(e)
        for other in redundant:  # after the insert: the trie never empties on the way
            self.remove(other)
        # It fits: what stays besides it (pinned, locked) leaves room. Held while
        # evicting, since a value policy's ranks move as entries go.
        e.refs += 1
        self.evict()
        e.refs -= 1
        assert not self.budget.over() or self.budget.victim() is None, "over budget"
        return True

    def hand_over(self, e: Entry, need: int, after: int | None = None) -> bool:
        """Give `e` to the request about to extend it (`PromptCache.hand_over`), removing it,
        when the budget cannot hold it beside the `need` more bytes that request will
        hold; False (nothing changes) when it can, or when `e` is pinned or another
        request holds it, or when `after` (the request's bytes at its end) would not fit
        beside what stays without it. Not an eviction: its tokens live on in the request,
        whose end stores them again (the new entry replaces it), so nothing else goes to
        make room for a second copy of the same KV."""
        used = self.budget.used()
        if e.refs or e.pinned or used + need <= self.budget.nbytes:
            return False
        stays = used - self.table.resident.share(e.buffers)  # once `e` is gone
        if after is not None and stays + after > self.budget.nbytes:
            return False
        self.remove(e)
        self.counters.handed_over += 1
        return True

    def restored(self, model_key: str, tokens: TokenIds, reuse: int, e: Entry) -> None:
        """A request restores `reuse` tokens of `tokens` from `e` (mutates): one more use of
        that prefix, counted on `e`, on the stored entries within it, and for the entries
        the request will store under it (`eviction/uses.py`)."""
        prefix = TokenIds(tokens[:reuse])
        uses = 1 + self.lineage.inherited(model_key, prefix)
        # Only a restore of most of `e` is a use of `e`: many one-shot prompts sharing a
        # template's head with one entry must not make it frequent (it would outlast the
        # system prompts they share).
        if reuse >= INHERIT_SHARE * len(e.tokens):
            e.uses = uses = 1 + max(e.uses, uses - 1)
        for found in self.table.trie(model_key).match(prefix).ancestors:
            other = self.entries[found.value]
            if other is not e:
                other.uses += 1
        self.lineage.restored(model_key, prefix, uses)

    def stored(self, model_key: str, key: tuple[int, ...]) -> Entry | None:
        entry_id = self.table.trie(model_key).get(key)
        return self.entries[entry_id] if entry_id is not None else None

    def touch(self, e: Entry) -> None:
        e.last_access = self.clock()
        self.policy.touch(e)

    def evict(self) -> None:
        """Evict down to the limits (every change that adds bytes ends here), and note
        the peak of what is held."""
        while self.budget.over():
            victim = self.budget.victim()
            if victim is None:
                break  # everything left is pinned or in use
            short = self.budget.used() - self.budget.nbytes
            v = victim
            self.evicted.add(v.model_key, v.tokens, v.trimmable, v.nbytes, short)
            self.remove(victim)
            self.counters.evictions += 1
        self.counters.peak_bytes = max(self.counters.peak_bytes, self.budget.used())

    def remove(self, e: Entry) -> None:
        assert e.refs == 0, "removing a locked entry"
        self.policy.remove(e)
        self.table.remove(e)

    def check_integrity(self) -> None:
        """Assert the store's invariants. Does not mutate."""
        self.budget.active.check_integrity()
        self.table.check_integrity()
        self.policy.check_integrity(self.entries)
        for e in self.entries.values():
            assert e.refs >= 0 and e.nbytes >= 0
            assert e.payload.length == len(e.tokens)
            assert e.pinned == ((e.model_key, e.tokens) in self.pins), "pin flag"
        if self.budget.over():
            assert self.budget.victim() is None, "over budget with evictable entries left"
