"""Which prefix positions of a request go to disk: the scoped disk policy (seed 004).

Scopes, per server (default) and per request (`prefix_cache.scope` overrides it):
  off      nothing
  full     every checkpoint of the prompt, and the end of prefill itself
  N        the first N tokens: the largest grid point <= N
  auto[:N] the longest common token prefix between this request and any of the last N
           requests of the same model (default N = 16), aligned down to the largest
           checkpoint of this prompt at or below it (a chat boundary, stable across
           turns); and from their first sight, so one request, a restart and the same
           request hits: the system prompt's end and the client's own breakpoints
           (`cache_control`: the protected checkpoint kinds, or other checkpoints a
           breakpoint landed on), which the client says it will send again

A shorter, shared prefix hits across requests whose tails differ (tool results, the
latest turn), where a full-prompt key would miss: `auto` trades cached tokens for hit
rate. The end of prefill is a real candidate (seed 004's bug: a snapshot exactly at
the end of the prompt must be captured and saved, not skipped).

Pure Python (no MLX). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from mlx_prefix.cache.eviction.policy import PROTECTED_ABOVE
from mlx_prefix.cache.token_ids import packed as packed_ids
from mlx_prefix.cache.types import CheckpointKind
from mlx_prefix.config import DEFAULT_SCOPE, MAX_AUTO_WINDOW, DiskScope, ScopeMode


class _Position(Protocol):
    @property
    def position(self) -> int: ...
    @property
    def kind(self) -> CheckpointKind: ...
    @property
    def marked(self) -> bool: ...


class PromptLike(Protocol):
    """What `select` reads of a `prompt.boundaries.RenderedPrompt`."""

    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def checkpoints(self) -> Sequence[_Position]: ...


class DiskPolicy:
    """Chooses the positions of each request to persist. Keeps, per model key, the
    token ids of the last MAX_AUTO_WINDOW requests (for `auto`)."""

    def __init__(self, default: DiskScope | str = DEFAULT_SCOPE, *, min_tokens: int = 0):
        self.default = DiskScope.parse(default) if isinstance(default, str) else default
        self.min_tokens = min_tokens  # positions below this are never worth a file
        self._lock = threading.Lock()
        self._history: dict[str, deque[bytes]] = {}  # model key -> int32 token bytes, oldest first

    def select(
        self,
        model_key: str,
        prompt: PromptLike,
        align: Callable[[int], int],
        scope: DiskScope | str | None = None,
        *,
        trimmable: bool = False,
    ) -> list[int]:
        """Positions (ascending, each 0 < p <= len(tokens), each a grid point or the end)
        whose snapshots should be saved for this request. Call once per request: it also
        records the request for later `auto` selections (mutates the history).

        `align(n)` is the largest grid point <= n of this prompt. `scope` (a DiskScope
        or its text) overrides the default; ValueError if the text is invalid.
        `trimmable`: the model's cache can be trimmed, so one snapshot serves every
        shorter prefix and only the largest position is returned.
        """
        if isinstance(scope, str):
            scope = DiskScope.parse(scope)
        scope = scope or self.default
        tokens = prompt.tokens
        n = len(tokens)
        packed = packed_ids(tokens)  # int64: a key's image values are 62-bit
        with self._lock:
            history = self._history.setdefault(model_key, deque(maxlen=MAX_AUTO_WINDOW))
            recent = list(history)[-scope.n :] if scope.mode is ScopeMode.AUTO else []
            history.append(packed)
        checkpoints = sorted({cp.position for cp in prompt.checkpoints if 0 < cp.position <= n})
        if scope.mode is ScopeMode.OFF or n == 0:
            positions: list[int] = []
        elif scope.mode is ScopeMode.FULL:
            positions = checkpoints
            # The end of prefill: a trimmable snapshot there serves every prefix; a
            # non-trimmable one only matches later on the grid.
            if n not in positions and (trimmable or align(n) == n):
                positions = [*positions, n]
        elif scope.mode is ScopeMode.FIXED:
            p = align(min(scope.n, n))
            positions = [p] if p > 0 else []
        else:
            shared = max((_common_prefix(packed, h) for h in recent), default=0)
            below = [p for p in checkpoints if p <= shared]
            protected = {
                cp.position
                for cp in prompt.checkpoints
                if (cp.kind > PROTECTED_ABOVE or cp.marked) and 0 < cp.position <= n
            }
            positions = sorted(protected | set(below[-1:]))
        positions = [p for p in positions if p >= self.min_tokens]
        return positions[-1:] if trimmable else positions

    def forget(self, model_key: str | None = None) -> None:
        """Drop the request history (of one model key, or all). Mutates."""
        with self._lock:
            if model_key is None:
                self._history.clear()
            else:
                self._history.pop(model_key, None)


def _common_prefix(a: bytes, b: bytes) -> int:
    """Common prefix length in tokens of two int64 token byte strings: a binary search
    over bytes comparisons (memcmp), no Python loop over tokens."""
    hi = min(len(a), len(b)) // 8
    if a[: 8 * hi] == b[: 8 * hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi] (in tokens)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[8 * lo : 8 * mid] == b[8 * lo : 8 * mid]:
            lo = mid
        else:
            hi = mid
    return lo
