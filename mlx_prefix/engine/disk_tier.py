"""The engine's view of the disk tier: lookups on memory misses, deferred saves.

Saves are queued during prefill and written by the engine thread when it has nothing
else to do (or once they have waited too long), so a request's first token never
waits for a disk write. What is queued is an immutable snapshot: the request goes on
writing into its own cache meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_prefix.cache.disk import DiskCache, DiskMatch
from mlx_prefix.cache.disk_policy import DiskPolicy, DiskScope, ScopeMode
from mlx_prefix.cache.snapshot import Snapshot
from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import DiskConfig
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.boundaries import RenderedPrompt

log = logging.getLogger("mlx_prefix.engine")

MAX_SAVE_DELAY_S = 5.0  # a queued save older than this is written even while busy


@dataclass(frozen=True, slots=True)
class _PendingSave:
    tokens: tuple[int, ...]
    snapshot: Snapshot
    kind: CheckpointKind
    queued_at: float


class DiskTier:
    def __init__(self, config: DiskConfig, model_key: str, trimmable: bool):
        self.config = config
        self.model_key = model_key
        self.trimmable = trimmable  # one snapshot serves every shorter prefix
        self.cache = DiskCache(config.path(), config.budget_bytes)
        self.policy = DiskPolicy(config.scope, min_tokens=config.min_tokens)
        self._pending: deque[_PendingSave] = deque()

    @staticmethod
    def parse_scope(scope: str | None) -> DiskScope | None:
        """Validate a per-request scope in the caller's thread."""
        if scope is None:
            return None
        try:
            return DiskScope.parse(scope)
        except ValueError as e:
            raise InvalidRequest(str(e), param="prefix_cache.scope") from None

    def is_off(self, scope: str | None) -> bool:
        chosen = self.parse_scope(scope) or self.policy.default
        return chosen.mode is ScopeMode.OFF

    def lookup(
        self, tokens: Sequence[int], align: Callable[[int], int], better_than: int
    ) -> tuple[DiskMatch, Snapshot] | None:
        """A disk checkpoint reusing more than `better_than` tokens, loaded and verified."""
        match = self.cache.match(self.model_key, tokens, align)
        if match is None or match.reuse_tokens < better_than + self.config.min_tokens:
            return None  # not worth reading a file for what memory (nearly) gives
        snapshot = self.cache.load(match)
        return (match, snapshot) if snapshot is not None else None

    def positions(
        self, prompt: RenderedPrompt, align: Callable[[int], int], scope: str | None
    ) -> set[int]:
        """Positions of this prompt to persist (records the request for `auto`)."""
        return set(
            self.policy.select(self.model_key, prompt, align, scope, trimmable=self.trimmable)
        )

    def defer(self, tokens: Sequence[int], snapshot: Snapshot, kind: CheckpointKind) -> None:
        self._pending.append(_PendingSave(tuple(tokens), snapshot, kind, time.monotonic()))

    def write_pending(self, busy: bool) -> None:
        """Write one queued save: the oldest when idle, only an overdue one when busy.
        One per engine turn, so a request that arrives meanwhile waits for one file at
        most."""
        if not self._pending:
            return
        if busy and time.monotonic() - self._pending[0].queued_at < MAX_SAVE_DELAY_S:
            return
        item = self._pending.popleft()
        self.cache.save(self.model_key, item.tokens, item.snapshot, item.kind)

    @property
    def pending(self) -> int:
        return len(self._pending)
