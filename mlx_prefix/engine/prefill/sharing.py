"""In-flight sharing: a prefix a prefilling request shares with requests still waiting.

A request waiting to start that shares a long prefix with one already prefilling waits
for that prefix's checkpoint (engine/loop.py) rather than compute it again beside it.
A trimmable cache's end-of-prompt snapshot serves every shared prefix already; a cache
that can only resume from exact checkpoints gets one at each shared prefix's end
(SharedPrefixes, asked by the Checkpointer at each boundary: checkpoints.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mlx_prefix.prompt.request.grid import ChunkGrid
from mlx_prefix.prompt.request.render import common_prefix_length


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
