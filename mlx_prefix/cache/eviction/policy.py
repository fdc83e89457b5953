"""The prompt cache's eviction policy: in which order stored checkpoints go.

The policy only orders entries. The store (`store.PromptCache`) decides when to evict
(over its byte budget or entry cap) and which entries may go at all (never a pinned
or locked one): it takes the first evictable entry of `order()`.

Two policies:
- `KindLRU`: lower `CheckpointKind` first (CANCELLED < PERIODIC < HISTORY <
  LAST_MESSAGE < the protected kinds), least recently used first within a kind.
- `ValueLRU` (the engine's default): the protected kinds (above LAST_MESSAGE: the
  system prompt, client cache breakpoints) keep KindLRU's order and go after every
  other entry; the others go by value, Marconi's (Pan et al., MLSys 2025) mix of
  recency and prefill work saved per byte held:
      score = recency + alpha * efficiency, lowest evicted first
  recency: the entry's rank from least (0) to most (1) recently used; efficiency:
  log(saved_work / share_bytes), scaled to 0..1 over the entries ranked. `saved_work`
  is the prefill work (model cost of the tokens, attention's growth with position
  included) lost if the entry goes: from what the other stored entries would serve
  of it (`entries.py`: its longest stored prefix, or more for a dense model, whose
  trimmable entries serve every prefix they share) to its end. An entry that saves
  nothing goes first. `share_bytes` is what removing the entry frees now: the buffers
  no other entry holds (`residency.py`: a parent whose children build on its KV piece
  frees only its own state, folding the piece into them at no copy; a leaf frees its
  piece too; so the ranking weighs a fold against evicting the leaves by what each
  frees per prefill it costs). Log scale: work per byte
  spans orders of magnitude (a recurrent-state-only checkpoint against a whole KV
  prefix), and a raw scale would let the extremes flatten everyone else. An entry
  with one stored extension (`children == 1`: a later checkpoint of the same path
  serves every request that continues past it) counts `passed_weight` of its work;
  for trimmable entries the coverage above already says so (an extension serves all
  of it), so this weighs the exact-only checkpoints of hybrid models.
  CANCELLED entries (a cancelled prefill's: issue 55) go before all of these, least
  recently used first, whatever their value: nobody asked for them, so they take only
  room no other entry wants and never push one out.

  Why alpha = 2.5 (Marconi tunes it per workload; it was 1.5): it is how much work
  per byte outweighs recency. With the scale's span of log(100), an entry e^(span /
  alpha) times as efficient, ~6x, outlasts one the whole recency range newer (~21x
  at 1.5). In the benchmark's mixed traffic (issue 14) a document's end saves ~20
  tokens of work per MiB, a chat's or a one-shot's ~5; at 1.5 the newest entry
  always outranked a document asked about again later. Replayed through this store
  (tests/support/trace_sim.py: the run's recorded requests, reproducing its figures request
  by request), 2.5 and the coverage restore, against the kind order, on the dense
  model 1.48x at 256 MiB, 1.22x at 320, 1.86x at 384, 1.51x at 448 and 1.21x at 512
  (1.5: 1.00, 0.99, 1.78, 1.45, 1.21); on the hybrid 1.12x at 40 MiB (1.5: 0.84),
  1.48x at 48, 1.28x at 56-64, as before. At the dense benchmark's 288 MiB it keeps
  no document's end past the next request, as the kind order does (1.00x; the test
  of tests/support/trace_sim.py says why); alpha 4 would (1.65x) but loses 5% on the hybrid
  at 40 MiB and 6% on the synthetic hybrid at 2 GiB. On the synthetic mixed workload
  (tests/support/cache_sim.py) 2.5 is ahead of the kind order at 4 GiB (1.11x dense and
  hybrid) and level (1.00-1.04x) at 2 and 8 GiB.

A policy is not thread-safe: the store calls it with its lock held. It holds the
store's entries by reference and may read their fields at any time; the store tells
it of every change that can move an entry in its order (`add`, `remove`, `touch`,
`change_kind`; `saved_work` and `share_bytes` are read when ranking).

Pure Python (no MLX).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from mlx_prefix.cache.types import CheckpointKind

# Efficiency is scaled to 0..1 over at least this range of its log: entries within a
# factor of 100 of each other in work per byte never span the whole recency range.
_MIN_SPAN = math.log(100.0)
# Efficiency's weight against recency (the module docstring says why this value).
ALPHA = 2.5

# Kinds above this one are protected: evicted after every other entry, by kind then LRU.
PROTECTED_ABOVE = CheckpointKind.LAST_MESSAGE
# The kind evicted before every other, by LRU alone (ValueLRU ranks no value for it).
FIRST_TO_GO = CheckpointKind.CANCELLED


class Evictable(Protocol):
    """What a policy may read of a stored entry (the store's own entry record)."""

    entry_id: int
    kind: CheckpointKind
    nbytes: int
    tokens: tuple[int, ...]
    last_access: float  # the store's clock at the last insert/acquire
    saved_work: float  # prefill work lost if it goes (from its longest stored prefix)
    share_bytes: float  # what removing it frees: its buffers no other entry holds
    children: int  # stored entries whose longest stored strict prefix it is


E = TypeVar("E", bound=Evictable)


@dataclass(frozen=True, slots=True)
class Candidate:
    """An entry about to be inserted, as a policy ranks it (the most recently used)."""

    kind: CheckpointKind
    length: int  # tokens
    saved_work: float
    share_bytes: float
    children: int = 0


class EvictionPolicy(Protocol[E]):
    def add(self, e: E) -> None:
        """Track a newly stored entry, the most recently used one (mutates)."""
        ...

    def remove(self, e: E) -> None:
        """Stop tracking `e` (mutates)."""
        ...

    def touch(self, e: E) -> None:
        """`e` was just used; its `last_access` is already updated (mutates)."""
        ...

    def change_kind(self, e: E, old: CheckpointKind) -> None:
        """`e.kind` was just changed from `old` (mutates)."""
        ...

    def order(self) -> Iterator[E]:
        """Every tracked entry, the first to be evicted first. Does not mutate; do not
        change the policy while iterating."""
        ...

    def outlasting(self, new: Candidate) -> set[int]:
        """Ids of the tracked entries that would be evicted after `new`, added now. The
        policy's part of the "would it fit" decision: the store counts these entries,
        with the pinned and locked ones, as staying when `new` is added. Does not
        mutate."""
        ...

    def check_integrity(self, entries: Mapping[int, E]) -> None:
        """Assert that the policy tracks exactly `entries` (by id). Does not mutate."""
        ...


def policy_named(name: str) -> EvictionPolicy:
    """A new policy of one of POLICIES' names; ValueError otherwise."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}: expected {' or '.join(POLICIES)}")
    return POLICIES[name]()


class KindLRU(Generic[E]):
    """Lower kind first; within a kind, least recently used first."""

    def __init__(self) -> None:
        # Per kind, entries in recency order (least recent first): the eviction queues.
        self._queues: dict[CheckpointKind, OrderedDict[int, E]] = {
            k: OrderedDict() for k in CheckpointKind
        }

    def add(self, e: E) -> None:
        self._queues[e.kind][e.entry_id] = e

    def remove(self, e: E) -> None:
        del self._queues[e.kind][e.entry_id]

    def touch(self, e: E) -> None:
        self._queues[e.kind].move_to_end(e.entry_id)

    def change_kind(self, e: E, old: CheckpointKind) -> None:
        del self._queues[old][e.entry_id]
        self.add(e)

    def order(self) -> Iterator[E]:
        for kind in CheckpointKind:  # ascending: lower kinds go first
            yield from self._queues[kind].values()  # least recently used first

    def outlasting(self, new: Candidate) -> set[int]:
        # The new entry would be the most recent of its kind: every entry of its kind or
        # a lower one goes before it.
        return {i for kind, q in self._queues.items() if kind > new.kind for i in q}

    def check_integrity(self, entries: Mapping[int, E]) -> None:
        queued = {i: e for q in self._queues.values() for i, e in q.items()}
        assert queued.keys() == entries.keys(), "eviction queues != entries"
        for kind, q in self._queues.items():
            assert all(e.kind == kind for e in q.values()), "entry in wrong queue"


class ValueLRU(Generic[E]):
    """CANCELLED first (LRU), protected kinds last (kind, then LRU); the others by
    recency + alpha * efficiency."""

    def __init__(self, alpha: float = ALPHA, passed_weight: float = 0.1) -> None:
        self.alpha = alpha
        self.passed_weight = passed_weight
        self._lru: OrderedDict[int, E] = OrderedDict()  # least recently used first

    def add(self, e: E) -> None:
        self._lru[e.entry_id] = e

    def remove(self, e: E) -> None:
        del self._lru[e.entry_id]

    def touch(self, e: E) -> None:
        self._lru.move_to_end(e.entry_id)

    def change_kind(self, e: E, old: CheckpointKind) -> None:
        pass  # the kind is read when ranking

    def order(self) -> Iterator[E]:
        yield from (e for e in self._lru.values() if e.kind == FIRST_TO_GO)
        ordinary = [e for e in self._lru.values() if FIRST_TO_GO < e.kind <= PROTECTED_ABOVE]
        scores = self._scores([(e.saved_work, e.share_bytes, e.children) for e in ordinary])
        ranked = sorted(range(len(ordinary)), key=lambda i: scores[i])  # stable: LRU ties
        yield from (ordinary[i] for i in ranked)
        protected = [e for e in self._lru.values() if e.kind > PROTECTED_ABOVE]
        yield from sorted(protected, key=lambda e: e.kind)  # stable: LRU within a kind

    def outlasting(self, new: Candidate) -> set[int]:
        protected = {e.entry_id for e in self._lru.values() if e.kind > PROTECTED_ABOVE}
        if new.kind > PROTECTED_ABOVE:
            return {i for i in protected if self._lru[i].kind > new.kind}
        ordinary = [e for e in self._lru.values() if FIRST_TO_GO < e.kind <= PROTECTED_ABOVE]
        if new.kind == FIRST_TO_GO:  # the newest of the first to go: everyone else stays
            return protected | {e.entry_id for e in ordinary}
        values = [(e.saved_work, e.share_bytes, e.children) for e in ordinary]
        scores = self._scores([*values, (new.saved_work, new.share_bytes, new.children)])
        mine = scores[-1]
        return protected | {e.entry_id for e, s in zip(ordinary, scores, strict=False) if s > mine}

    def check_integrity(self, entries: Mapping[int, E]) -> None:
        assert self._lru.keys() == entries.keys(), "recency list != entries"

    def _scores(self, values: list[tuple[float, float, int]]) -> list[float]:
        """Scores of entries given least recently used first, as (saved_work,
        share_bytes, children); the last is the most recent."""
        n = len(values)
        if not n:
            return []
        weighted = [work * (self.passed_weight if kids == 1 else 1.0) for work, _, kids in values]
        # None: saves nothing (another entry serves all of it): first to go, whatever its
        # recency, and kept out of the scale, which its log would stretch without bound.
        eff = [
            math.log(w / max(share, 1.0)) if w > 0 else None
            for w, (_, share, _) in zip(weighted, values, strict=True)
        ]
        known = [v for v in eff if v is not None]
        lo, hi = (min(known), max(known)) if known else (0.0, 0.0)
        span = max(hi - lo, _MIN_SPAN)
        recency = [i / (n - 1) if n > 1 else 1.0 for i in range(n)]
        return [
            r + self.alpha * (v - lo) / span if v is not None else -1.0
            for r, v in zip(recency, eff, strict=True)
        ]


# Every policy by its --cache-eviction name (the one registry: config and the CLI read it).
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"value": ValueLRU, "kind": KindLRU}
