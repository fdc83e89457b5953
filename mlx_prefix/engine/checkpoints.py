"""What one request's prefill leaves behind: the snapshots captured at its boundaries.

At each grid boundary the Checkpointer decides whether to capture the cache and where
the snapshot goes: into the memory store (planned checkpoints, prefixes shared with
waiting requests) and/or the disk queue (positions the disk policy chose, the end of
prefill included: seed 004's bug was a save there that silently never fired).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mlx_prefix.cache.snapshot import Snapshot, capture, restore
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.engine.disk_tier import DiskTier
from mlx_prefix.engine.runner import always_trimmable
from mlx_prefix.prompt.boundaries import RenderedPrompt, common_prefix_length
from mlx_prefix.prompt.grid import ChunkGrid


@dataclass(frozen=True, slots=True)
class WaitingPrompt:
    key: int  # identifies the waiting request
    tokens: tuple[int, ...]


class SharedPrefixes:
    """In-flight sharing for caches that can only resume from exact checkpoints.

    While a request prefills, requests waiting to start that share a long prefix with
    it get a checkpoint at that prefix's end (aligned down to the grid), so they
    restore from it instead of computing it again. Trimmable caches need none of this:
    their end-of-prompt snapshot already serves every shared prefix.
    """

    def __init__(
        self,
        tokens: Sequence[int],
        grid: ChunkGrid,
        waiting: Callable[[], Iterable[WaitingPrompt]],
        min_tokens: int,
    ):
        self.tokens, self.grid, self.waiting, self.min_tokens = tokens, grid, waiting, min_tokens
        self.seen: dict[int, int] = {}  # waiting key -> aligned shared position (0: none)

    def positions(self) -> set[int]:
        for other in self.waiting():
            if other.key in self.seen:
                continue
            shared = common_prefix_length(self.tokens, other.tokens)
            limit = min(shared, len(self.tokens) - 1, len(other.tokens) - 1)
            aligned = self.grid.align(self.tokens, limit)
            self.seen[other.key] = aligned if aligned >= self.min_tokens else 0
        return {p for p in self.seen.values() if p}


@dataclass
class Checkpointer:
    """The on_boundary callback of one request's prefill (engine thread only)."""

    prompt: RenderedPrompt
    cache: list
    reuse: int  # prefill starts here
    store: PromptCache
    key: str  # the request's entry key (model and namespace: engine/keys.py)
    shared: SharedPrefixes | None
    disk: DiskTier | None = None
    disk_positions: frozenset[int] = frozenset()  # chosen by the disk policy

    def __post_init__(self) -> None:
        self.planned = {
            c.position: c.kind for c in self.prompt.checkpoints if c.position > self.reuse
        }
        # An all-KV cache needs only its end-of-prompt snapshot: trimming serves the rest.
        self.keep_every_checkpoint = not always_trimmable(self.cache)
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
            return capture(self.cache, position)
        if self.keep_every_checkpoint:  # exact states only: the one memory holds, if any
            return self.store.get(self.key, self.prompt.tokens[:position])
        restored = capture(self.cache, self.reuse)  # views: trim them back to `position`
        return capture(restore(restored, trim=self.reuse - position), position)

    def __call__(self, position: int) -> None:
        tokens = self.prompt.tokens
        if self.shared is not None:
            for p in self.shared.positions():
                if p >= position:
                    self.planned[p] = max(
                        self.planned.get(p, CheckpointKind.LAST_MESSAGE),
                        CheckpointKind.LAST_MESSAGE,
                    )
        kind = self.planned.get(position)
        at_end = position == len(tokens)
        if at_end and kind is None:
            kind = CheckpointKind.HISTORY
        # An all-KV cache keeps its end (trimming serves every shorter prefix) and its
        # system prompt, which then outlives the conversations' ends under pressure.
        in_memory = kind is not None and (
            self.keep_every_checkpoint or at_end or kind is CheckpointKind.SYSTEM
        )
        to_disk = self.disk is not None and position in self.disk_positions
        if not in_memory and not to_disk:
            return
        snapshot = capture(self.cache, position)
        kind = kind if kind is not None else CheckpointKind.PERIODIC
        # An off-grid end (raw completions) is only reusable by trimming back.
        if in_memory and (not at_end or snapshot.trimmable or position in self.planned):
            self.store.insert(self.key, tokens[:position], snapshot, kind)
        if to_disk:
            self.disk.defer(self.key, tokens[:position], snapshot, kind)
