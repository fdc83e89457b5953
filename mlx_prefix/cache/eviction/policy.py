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

  Segmented (SLRU, as Caffeine's and ARC's): an entry of HISTORY or above whose prefix
  has been restored FREQUENT_USES (3) times, its conversation's count carried from turn
  to turn (uses.py), is frequent; the rest are probationary. Every probationary entry,
  the protected kinds included, goes before every frequent one; when the frequent
  entries hold more than FREQUENT_SHARE (0.8) of the budget, the least valuable of them
  are demoted: they rank with the probationary ones, so a new entry may outlast them.
  Why (issue 55 item 4): a main agent's conversation, restored every turn but the least
  recently used while its subagents run, went before their newer turns and their
  protected system prompts; with the segments it stays (tests/engine/test_engine_subagents.py).
  Why 3 uses, 0.8 and HISTORY (measured on the replays below): with 2 uses the dense
  trace lost up to a third (384 MiB: 1.02x, against 1.52x); with PERIODIC checkpoints
  frequent too, a hybrid's checkpoints filled the segment (synthetic hybrid, 4 GiB:
  1.056x); at 0.6 the test's main agent (~0.65 of its budget) is demoted. Against the
  kind order, the replays (tests/support/trace_sim.py) are unchanged at every budget; the
  synthetic mixed workload (tests/support/cache_sim.py) moves dense 1.005/1.107/1.001x ->
  1.050/1.114/1.007x at 2/4/8 GiB, hybrid 0.998/1.085/1.040x -> 1.041/1.081/1.046x.

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
`change_kind`; `saved_work`, `share_bytes` and `uses` are read when ranking), and
binds it to the budget (`bind`), which ValueLRU reads for its frequent segment's cap.

Pure Python (no MLX).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from mlx_prefix.cache.types import Buffer, CheckpointKind

# Efficiency is scaled to 0..1 over at least this range of its log: entries within a
# factor of 100 of each other in work per byte never span the whole recency range.
_MIN_SPAN = math.log(100.0)
# Efficiency's weight against recency (the module docstring says why this value).
ALPHA = 2.5

# Segmented LRU (issue 55: subagents must not evict the main agent): an entry of at
# least FREQUENT_KIND whose prefix was restored FREQUENT_USES times (its conversation's
# count: uses.py) is frequent; the frequent segment goes after every probationary entry
# and holds at most FREQUENT_SHARE of the budget (the module docstring says why these).
FREQUENT_USES = 3
FREQUENT_SHARE = 0.8
FREQUENT_KIND = CheckpointKind.HISTORY

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
    uses: int  # requests that restored a prefix of it, its conversation's (uses.py)
    buffers: tuple[Buffer, ...]


E = TypeVar("E", bound=Evictable)


@dataclass(frozen=True, slots=True)
class Candidate:
    """An entry about to be inserted, as a policy ranks it (the most recently used)."""

    kind: CheckpointKind
    length: int  # tokens
    saved_work: float
    share_bytes: float
    children: int = 0
    uses: int = 0  # requests that restored its longest restored prefix (uses.py)
    buffers: tuple[Buffer, ...] = ()


class EvictionPolicy(Protocol[E]):
    def bind(self, budget: Callable[[], int]) -> None:
        """The store's byte budget, read when ranking (mutates)."""
        ...

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

    def bind(self, budget: Callable[[], int]) -> None:
        pass  # the kind order needs no budget

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
    """CANCELLED first (LRU); then the probationary segment, then the frequent one
    (segmented LRU); within a segment, ordinary kinds by recency + alpha * efficiency,
    then the protected kinds (kind, then LRU)."""

    def __init__(self, alpha: float = ALPHA, passed_weight: float = 0.1) -> None:
        self.alpha = alpha
        self.passed_weight = passed_weight
        self._lru: OrderedDict[int, E] = OrderedDict()  # least recently used first
        self._budget: Callable[[], int] | None = None  # None: the frequent segment is uncapped

    def bind(self, budget: Callable[[], int]) -> None:
        self._budget = budget

    def add(self, e: E) -> None:
        self._lru[e.entry_id] = e

    def remove(self, e: E) -> None:
        del self._lru[e.entry_id]

    def touch(self, e: E) -> None:
        self._lru.move_to_end(e.entry_id)

    def change_kind(self, e: E, old: CheckpointKind) -> None:
        pass  # the kind is read when ranking

    def order(self) -> Iterator[E]:
        yield from self._ranked(list(self._lru.values()))

    def outlasting(self, new: Candidate) -> set[int]:
        # The new entry ranked as the most recent: every entry after it stays.
        ranked = self._ranked([*self._lru.values(), new])
        mine = next(i for i, x in enumerate(ranked) if x is new)
        return {x.entry_id for x in ranked[mine + 1 :] if not isinstance(x, Candidate)}

    def check_integrity(self, entries: Mapping[int, E]) -> None:
        assert self._lru.keys() == entries.keys(), "recency list != entries"

    def _ranked(self, items: list[Any]) -> list[Any]:
        """`items` (entries or a candidate, least recently used first) in eviction order.
        A frequent segment over its cap is demoted from its least valuable end: those
        entries rank with the probationary ones (by value, recency included), so a new
        entry can outlast them."""
        first = [x for x in items if x.kind == FIRST_TO_GO]
        rest = [x for x in items if x.kind != FIRST_TO_GO]
        frequent = self._by_value([x for x in rest if _frequent(x)])
        demoted = {id(x) for x in frequent[: self._over_cap(frequent)]}
        probation = [x for x in rest if not _frequent(x) or id(x) in demoted]
        kept = frequent[len(demoted) :]
        return [*first, *self._by_value(probation), *kept]

    def _by_value(self, group: list[Any]) -> list[Any]:
        ordinary = [x for x in group if x.kind <= PROTECTED_ABOVE]
        scores = self._scores([(x.saved_work, x.share_bytes, x.children) for x in ordinary])
        ranked = sorted(range(len(ordinary)), key=lambda i: scores[i])  # stable: LRU ties
        protected = [x for x in group if x.kind > PROTECTED_ABOVE]
        return [*(ordinary[i] for i in ranked), *sorted(protected, key=lambda x: x.kind)]

    def _over_cap(self, frequent: list[Any]) -> int:
        """How many of `frequent` (eviction order) to demote: the least valuable, until
        the distinct bytes of the rest are within FREQUENT_SHARE of the budget."""
        if self._budget is None:
            return 0
        cap, held, seen = FREQUENT_SHARE * self._budget(), 0, set()
        for i in range(len(frequent) - 1, -1, -1):  # the most valuable first
            for b in frequent[i].buffers:
                if b.key not in seen:
                    seen.add(b.key)
                    held += b.nbytes
            if held > cap:
                return i + 1
        return 0

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


def _frequent(x: Evictable | Candidate) -> bool:
    return x.uses >= FREQUENT_USES and x.kind >= FREQUENT_KIND


# Every policy by its --cache-eviction name (the one registry: config and the CLI read it).
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"value": ValueLRU, "kind": KindLRU}
