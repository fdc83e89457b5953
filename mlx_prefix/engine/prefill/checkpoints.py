"""What one request's prefill leaves behind: the snapshots captured at its boundaries.

At each grid boundary the Checkpointer decides whether to capture the cache and where
the snapshot goes: the memory store (planned checkpoints, prefixes shared with waiting
requests, the branch point) and/or the disk queue (positions the disk policy chose, the
end of prefill included: seed 004's bug was a save there that silently never fired).

Every snapshot holds its attention KV as a chain of pieces (cache/chain.py): `chain`
starts as the restored entry's, up to the restored position, and each capture adds a
piece copied from the cache for what this prefill computed since the last one, so a
conversation's next turn stores only what it added. A cache with recurrent or rotating
layers keeps every checkpoint (it resumes only from an exact one); those of the ordinary
kinds are stored when the prefill ends or stops between chunks (`finish`), waiting
requests starting only after that (in-flight sharing finds them), and a failed prefill
stores none; the protected kinds (above LAST_MESSAGE: the system prompt, a client's
breakpoint) at once. Under a tight budget the end's KV comes from the decode row instead
(cache/handover.py), a hybrid's checkpoints' too (rows.py: their other layers only).

The request's active bytes count the chain's pieces and the captured state of the
checkpoints not stored yet (`held`), each once with the stored entries that hold them
too (cache/eviction/active.py).

A cancelled prefill (issue 55) keeps what it computed: where it stops (cancelled.py),
and, when it runs on once its client has gone (`cancel`), what it reaches from then on:
CANCELLED entries (the protected kinds aside), the first to go, pushing out no other.

Branch point (Marconi's admission rule): when the prompt leaves a stored sequence
past the restored position (an edit, a new question, another tool result), the grid
point at or before the divergence becomes a checkpoint, so the next request of
either shape restores there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlx_prefix.cache.chain import Chain
from mlx_prefix.cache.eviction.policy import PROTECTED_ABOVE
from mlx_prefix.cache.handover import hybrid, room_needed
from mlx_prefix.cache.snapshot import (
    Snapshot,
    cache_nbytes,
    capture,
    is_trimmable,
    restore,
    shortened,
    with_draft,
)
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.cache.types import Buffer
from mlx_prefix.engine.forward.runner import always_trimmable
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.prefill.rows import RowStates
from mlx_prefix.engine.prefill.sharing import SharedPrefixes
from mlx_prefix.prompt.request.plan import RenderedPrompt

# Kinds an all-KV cache stores besides its prompt's end (which trimming serves from).
KEPT_FOR_KV = frozenset({CheckpointKind.SYSTEM, CheckpointKind.BREAKPOINT})


@dataclass(frozen=True, slots=True)
class _Deferred:
    snapshot: Snapshot
    kind: CheckpointKind
    in_memory: bool
    to_disk: bool


@dataclass
class Checkpointer:
    """The on_boundary callback of one request's prefill (engine thread only)."""

    prompt: RenderedPrompt
    cache: list
    reuse: int  # prefill starts here
    store: PromptCache
    key: str  # the request's entry key (model and namespace: engine/keys.py)
    shared: SharedPrefixes | None
    disk: DiskAccess | None = None
    disk_positions: frozenset[int] = frozenset()  # chosen by the disk policy
    branch: int = 0  # a grid point where the prompt leaves a stored sequence (0: none)
    on_stored: Callable[[int], None] = lambda position: None  # a prefix went into memory
    # Keep every grid checkpoint even if the cache is all KV now: it will be quantized
    # in this prefill, and quantized states restore only exactly (engine/forward/kv_quant.py).
    exact_only: bool = False
    # --draft-model: the draft's cache, at each checkpoint's position too; captured
    # beside the target's (engine/decode/speculative.py). Only with always-trimmable caches.
    draft: list | None = None
    # Reports the request's active bytes (its cache, `held`) to the store; called before
    # storing a snapshot, so that its pieces count once.
    report: Callable[[], None] = lambda: None
    # The pieces holding the cache's first positions (the restored entry's, up to
    # `reuse`), and the draft's; each capture continues them (cache/chain.py).
    chain: Chain = Chain()
    draft_chain: Chain = Chain()
    # The request was cancelled (`cancel`): what is stored from then on is CANCELLED.
    cancelled: bool = False
    # The entry it restored was handed to it (cache/handover.py): its prompt's end is
    # stored from its decode row when it finishes (`end_kind`), not copied here.
    hand_back: bool = False
    # A plain-KV cache of a request that decodes: its end goes the same way whenever the
    # budget cannot hold its piece beside the live cache (a first turn at ~1x its KV).
    may_hand_back: bool = False

    def __post_init__(self) -> None:
        self.planned = {
            c.position: c.kind for c in self.prompt.checkpoints if c.position > self.reuse
        }
        # An all-KV cache needs only its end-of-prompt snapshot: trimming serves the rest.
        self.keep_every_checkpoint = self.exact_only or not always_trimmable(self.cache)
        if self.keep_every_checkpoint and self.reuse < self.branch < len(self.prompt.tokens):
            self._plan(self.branch, CheckpointKind.LAST_MESSAGE)
        self._deferred: list[_Deferred] = []
        self._kept: set[int] = set()  # positions stored in memory by this prefill
        self.end_kind: CheckpointKind | None = None  # the end, left to decode (`hand_back`)
        # A hybrid's checkpoints whose KV its decode row gives (rows.py); all of them
        # after a hand-over (a piece would copy the prefix again).
        self.rows = RowStates(
            cache=self.cache,
            store=self.store,
            key=self.key,
            tokens=self.prompt.tokens,
            on_stored=self.on_stored,
        )
        self._rows_kv = self.hand_back and hybrid(self.cache)
        self.stride = 0  # periodic checkpoints only at multiples of this (0: all; `_thin`)
        self.finished = False
        if self.disk is not None:
            # Positions the policy chose that prefill will not reach (restored from memory
            # past them) are persisted from what memory holds (seed 004: a chosen save
            # must happen, whatever served the request).
            kinds = {c.position: c.kind for c in self.prompt.checkpoints}
            for position in sorted(p for p in self.disk_positions if p <= self.reuse):
                snapshot = self._restored_prefix(position)
                prefix = self.prompt.tokens[:position]
                if snapshot is not None:
                    kind = kinds.get(position, CheckpointKind.PERIODIC)
                    self.disk.defer(self.key, prefix, snapshot, kind)
                elif not self.disk.cache.holds(self.key, prefix):
                    # An exact state below the restore point is gone (evicted, or never
                    # kept in memory); recomputing it would cost the request a prefill.
                    why = f"memory restored {self.reuse} tokens and no longer holds that state"
                    self.disk.drop(position, why)

    def _restored_prefix(self, position: int) -> Snapshot | None:
        """A snapshot of the first `position` (<= reuse) prompt tokens, without compute."""
        if position == self.reuse:
            return capture(self.cache, position, self.chain)  # the chain holds it all
        if self.keep_every_checkpoint:  # exact states only: the one memory holds, if any
            return self.store.get(self.key, self.prompt.tokens[:position])
        restored = capture(self.cache, self.reuse, self.chain)
        return shortened(restored, position) or capture(
            restore(restored, trim=self.reuse - position), position
        )

    def _plan(self, position: int, kind: CheckpointKind) -> None:
        self.planned[position] = max(self.planned.get(position, kind), kind)

    def owes_after(self, position: int) -> bool:
        """Whether a state past `position` must be stored for others: a protected
        checkpoint (the system prompt, a client's breakpoint), a disk save the policy
        chose, or a prefix a waiting request will restore (engine/prefill/tails.py)."""
        if any(p > position for p in self.disk_positions):
            return True
        if any(p > position and k > PROTECTED_ABOVE for p, k in self.planned.items()):
            return True
        return self.shared is not None and any(p > position for p in self.shared.positions())

    def stack_point(self) -> int:
        """The position from which this prompt's rest may compute stacked with others'
        (engine/prefill/tails.py): its last planned checkpoint before its end (0: none
        past the restored prefix). A chat's next turn is this prompt, the reply and a new
        message, so it restores at the latest state stored inside this prompt: computed
        alone up to here and stored (`keep_stack_start`), only the few tokens after it
        stack (the generation prompt's `assistant` line in ChatML), and the next turn
        finds nearly all of it."""
        end = len(self.prompt.tokens)
        return max((p for p in self.planned if p < end), default=0)

    def keep_stack_start(self, position: int) -> None:
        """Store the cache at `position`, where a stacked forward takes over (a grid
        point this prefill reached alone: an exact state, invariant 12), unless it is
        the restored prefix or already stored or deferred. An all-KV cache otherwise
        stores only its end, which a stacked rest never reaches alone."""
        if self.finished or position <= self.reuse or position in self._kept:
            return
        if self.keep_every_checkpoint and position in self.planned:
            return  # stored at its boundary (`__call__`), or deferred and settled next
        kind = self.planned.get(position, CheckpointKind.PERIODIC)
        self.keep(self.capture_at(position), kind, True, False)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the checkpoints not stored yet besides their chain's pieces (their
        captured recurrent / rotating state)."""
        pieces = {b.key for d in self._deferred for b in _chain_buffers(d.snapshot)}
        own = {b.key: b for d in self._deferred for b in d.snapshot.buffers if b.key not in pieces}
        return sum(b.nbytes for b in own.values())

    def held(self) -> tuple[Buffer, ...]:
        """What this prefill keeps alive besides its cache: the chains' pieces and the
        checkpoints not stored yet, each buffer once (stored entries may hold them too)."""
        found = {b.key: b for b in (*self.chain.buffers, *self.draft_chain.buffers)}
        found.update((b.key, b) for b in self.rows.buffers)
        for d in self._deferred:
            found.update((b.key, b) for b in d.snapshot.buffers)
        return tuple(found.values())

    def __call__(self, position: int) -> None:
        tokens = self.prompt.tokens
        assert not self.finished, "boundary after finish"
        if self.shared is not None:
            for p in self.shared.positions():
                if p >= position:
                    self._plan(p, CheckpointKind.LAST_MESSAGE)
        kind = self.planned.get(position)
        at_end = position == len(tokens)
        if at_end and kind is None:
            kind = CheckpointKind.HISTORY
        # An all-KV cache keeps its end (trimming serves every shorter prefix), its
        # system prompt and the client's breakpoints, which then outlive the
        # conversations' ends under pressure.
        in_memory = kind is not None and (
            self.keep_every_checkpoint or at_end or kind in KEPT_FOR_KV
        )
        to_disk = self.disk is not None and position in self.disk_positions
        if not in_memory and not to_disk:
            return
        kind = kind if kind is not None else CheckpointKind.PERIODIC
        if self.stride and position % self.stride and self._thinnable(kind, to_disk):
            return
        # An off-grid end (raw completions) is only reusable by trimming back.
        in_memory = in_memory and (
            not at_end or position in self.planned or is_trimmable(self.cache)
        )
        if in_memory and at_end and (self.hand_back or self.no_room(position)):
            if self.rows.keep(position, kind, at_end, self.report):  # a hybrid: if it fits
                self.end_kind = kind  # stored when the request finishes (decode/phase.py)
                self.on_stored(position)
            if not to_disk:
                return
            in_memory = False
        elif in_memory and not to_disk and (self.no_room(position) or self._rows_kv):
            # A second copy of what the live cache holds, which the budget cannot hold
            # beside it (its end serves this prefix by trimming): not cut at all; a
            # hybrid keeps its state here, its KV to come from the row (or the end).
            self.rows.keep(position, kind, at_end, self.report)
            return
        snapshot = self.capture_at(position)
        if at_end:  # its chain holds those kept without their KV
            self.rows.store_inside(snapshot)
        if self.keep_every_checkpoint and kind <= PROTECTED_ABOVE:
            self._deferred.append(_Deferred(snapshot, kind, in_memory, to_disk))
            self._thin(self.store.budget_bytes - cache_nbytes(self.cache))
            return
        self.keep(snapshot, kind, in_memory, to_disk)

    def no_room(self, position: int) -> bool:
        """A cache whose piece up to `position` the budget cannot hold beside what is
        stored and running (`may_hand_back`; cache/handover.py)."""
        if not self.may_hand_back:
            return False
        self.report()  # the live cache as it is now
        rest = len(self.prompt.tokens) - position  # a cancelled one's end is its live cache
        need = room_needed(self.cache, position - self.chain.end, rest, not self.cancelled)
        return not self.store.has_room(need)

    def capture_at(self, position: int) -> Snapshot:
        """The cache (and the draft's) at `position`, continuing their chains."""
        snapshot = capture(self.cache, position, self.chain)
        self.chain = snapshot.chain
        if self.draft is not None:
            draft = capture(self.draft, position, self.draft_chain)
            self.draft_chain = draft.chain
            snapshot = with_draft(snapshot, draft)
        return snapshot

    def _thin(self, room: int) -> None:
        """While pending states take more than `room` bytes (a big hybrid's state is
        ~150 MB), keep periodic checkpoints only at multiples of a doubled stride, so
        those kept stay evenly spread; later ones off the stride are not taken."""
        while self.pending_bytes > room:
            periodic = [d for d in self._deferred if self._thinnable(d.kind, d.to_disk)]
            if not periodic:
                return
            self.stride = 2 * (self.stride or min(d.snapshot.length for d in periodic))
            self._deferred = [
                d
                for d in self._deferred
                if not self._thinnable(d.kind, d.to_disk) or d.snapshot.length % self.stride == 0
            ]

    @staticmethod
    def _thinnable(kind: CheckpointKind, to_disk: bool) -> bool:
        return kind is CheckpointKind.PERIODIC and not to_disk

    def settle(self) -> None:
        """Store / queue the deferred checkpoints now (before a stacked rest or a
        quantization changes the cache; they hold their own copies). Mutates the store
        and the disk queue."""
        if self.finished:
            return
        while self._deferred:  # each counted in `held` until it is stored
            d = self._deferred[0]
            self.keep(d.snapshot, d.kind, d.in_memory, d.to_disk)
            self._deferred.pop(0)

    def cancel(self) -> None:
        """The request was cancelled and its prefill runs on for what it stores
        (engine/loop.py): the checkpoints reached so far are stored as planned, later
        ones as CANCELLED, the protected kinds aside. Mutates the store."""
        self.settle()
        self.cancelled = self.rows.cancelled = True

    def finish(self, *, keep: bool = True) -> None:
        """The prefill ended, or stopped between chunks: store / queue the deferred
        checkpoints (mutates the store and the disk queue; the cache is not changed).
        `keep=False` (the prefill failed, the cache may be broken) drops them. Lets go of
        the chains: what they hold is the stored entries' now. Idempotent."""
        if self.finished:
            return
        if keep:
            self.settle()
        self._deferred = []
        self.chain = self.draft_chain = Chain()
        self.finished = True

    def keep(
        self, snapshot: Snapshot, kind: CheckpointKind, in_memory: bool, to_disk: bool
    ) -> None:
        """Store and/or queue `snapshot`. The request reports what it holds first (its
        pieces among it), so that the store never counts them twice."""
        tokens = self.prompt.tokens[: snapshot.length]
        if in_memory:
            self._kept.add(snapshot.length)
            self.report()
            cancelled = self.cancelled and kind <= PROTECTED_ABOVE
            self.store.insert(
                self.key, tokens, snapshot, CheckpointKind.CANCELLED if cancelled else kind
            )
            self.on_stored(snapshot.length)
        if to_disk:
            assert self.disk is not None, "disk positions come from the disk tier"
            self.disk.defer(self.key, tokens, snapshot, kind)


def _chain_buffers(snapshot: Snapshot) -> tuple[Buffer, ...]:
    draft = snapshot.draft.chain.buffers if snapshot.draft is not None else ()
    return (*snapshot.chain.buffers, *draft)
