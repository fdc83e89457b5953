"""A hybrid request's checkpoints whose KV its decode row gives (issue 55, tight budgets).

When the store hands a request its entry, or the budget cannot hold a checkpoint's piece
beside the live cache, the prefill cuts no piece (cache/handover.py): a piece would copy
KV the live cache holds, and after a hand-over its chain is empty, so a piece would copy
the whole restored prefix again. A model with recurrent or rotating layers still needs
those layers' exact state at each checkpoint (it resumes only there): `RowStates` keeps
that state alone (small beside the KV), where the budget holds it beside the rest of the
prefill and the end's state, and the prompt's end always. When the request finishes,
its row's KV becomes the end's entry and each kept state an entry sharing its first
positions (`keep_inside`): one copy of the KV for all of them. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlx_prefix.cache.handover import EndState, hybrid, keep_inside, room_needed, states_at
from mlx_prefix.cache.snapshot import Snapshot
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.cache.types import Buffer


@dataclass
class RowStates:
    cache: list
    store: PromptCache
    key: str  # the request's entry key
    tokens: Sequence[int]  # its prompt
    on_stored: Callable[[int], None]
    states: list[EndState] = field(default_factory=list)  # in position order, the end last
    # The request was cancelled (`Checkpointer.cancel`): its end is stored from its live
    # cache, let go of (cancelled.py), not from a copy of its state beside it.
    cancelled: bool = False

    def keep(
        self, position: int, kind: CheckpointKind, at_end: bool, report: Callable[[], None]
    ) -> bool:
        """Keep the state at `position` where the budget holds it beside the rest of the
        prefill and the end's, evicting nothing (`at_end`: beside what eviction cannot
        free; the end is the entry the next turn extends); whether it was kept (always
        for a cache with only KV layers, which the row gives whole). `report` reports the
        request's active bytes as they are now: handed in, not kept, so that the
        Checkpointer and this record hold no cycle (its cache, the whole KV, would wait
        for Python's rare full collection)."""
        if not hybrid(self.cache) or (at_end and self.cancelled):
            return True
        report()
        state = states_at(self.cache, position, kind)
        if at_end:
            fits = self.store.could_hold(state.buffer.nbytes)
        else:
            rest = len(self.tokens) - position
            fits = self.store.has_room(room_needed(self.cache, 0, rest, not self.cancelled))
        if not fits:
            return False
        self.states.append(state)
        return True

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return tuple(s.buffer for s in self.states)

    def store_inside(self, end: Snapshot) -> None:
        """Store the kept states shorter than `end` (the row's or the cache's entry, stored
        after them: the last to be refused), its KV shared. Mutates the store."""
        for position in keep_inside(self.store, self.key, self.tokens, end, self.states):
            self.on_stored(position)
        self.states = []
