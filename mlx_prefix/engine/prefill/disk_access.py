"""The engine's view of the disk tier: lookups on memory misses, deferred saves.

Saves are queued during prefill and written by the engine thread when it has nothing
else to do (or once they have waited too long, while only prefill runs), so a
request's first token never waits for a disk write, and no write sits between two
tokens of a running request (a 600-token dense snapshot took 0.5-1.5 s to write on a
loaded machine: measured in a burst, every running request's gap). What is queued is
an immutable snapshot: the request goes on writing into its own cache meanwhile.

The queue is bounded (MAX_PENDING_SAVES: a full queue writes its oldest save at once),
and the queued snapshots' bytes that the memory store does not already hold count in
its byte budget (invariant 6) as one active entry. A queued save is written, or dropped
with a log line naming it (invariant 11: a shutdown that runs out of time).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_prefix.cache.disk.policy import DiskPolicy
from mlx_prefix.cache.disk.tier import DiskCache, DiskMatch
from mlx_prefix.cache.entries import buffers_of
from mlx_prefix.cache.snapshot import Snapshot
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.cache.token_ids import TokenIds
from mlx_prefix.config import DiskConfig, DiskScope
from mlx_prefix.prompt.request.plan import RenderedPrompt

log = logging.getLogger("mlx_prefix.engine")

MAX_SAVE_DELAY_S = 5.0  # a queued save older than this is written even while busy
MAX_PENDING_SAVES = 16  # a deferred save beyond this writes the oldest one first


@dataclass(frozen=True, slots=True)
class _PendingSave:
    key: str  # the entry key (model and namespace) it is saved under
    tokens: tuple[int, ...]
    snapshot: Snapshot
    kind: CheckpointKind
    queued_at: float


class DiskAccess:
    def __init__(
        self,
        config: DiskConfig,
        trimmable: bool,
        store: PromptCache,
        bytes_key: str,
        cache: DiskCache | None = None,
        agree: Callable[[int], bool] | None = None,
    ):
        """`cache`: a DiskCache shared with other engines (several models served at once:
        one index, one disk budget); None opens the configured folder. `agree`: a
        sharded group's check that every rank has the same value (a collective)."""
        self.config = config
        self.trimmable = trimmable  # one snapshot serves every shorter prefix
        self.cache = cache or DiskCache(config.path(), config.budget_bytes)
        self.policy = DiskPolicy(config.default_scope, min_tokens=config.min_tokens)
        self.store = store  # the queued snapshots' bytes count in its budget
        self._bytes_key = bytes_key
        self._pending: deque[_PendingSave] = deque()
        # Sharded (engine/sharded/lockstep.py): a disk hit is used only when every rank
        # has it.
        self.agree = agree
        self.dropped = 0  # saves given up (logged each): shutdown out of time, a lost state

    def is_off(self, scope: DiskScope | None) -> bool:
        """Whether a request of disk `scope` (None: the server's) writes nothing here."""
        return (scope or self.policy.default).off

    def lookup(
        self, key: str, tokens: Sequence[int], align: Callable[[int], int], better_than: int
    ) -> tuple[DiskMatch, Snapshot] | None:
        """A disk checkpoint of entry key `key` reusing more than `better_than` tokens,
        loaded and verified."""
        match = self.cache.match(key, tokens, align)
        if match is not None and match.reuse_tokens < better_than + self.config.min_tokens:
            match = None  # not worth reading a file for what memory (nearly) gives
        if self.agree is not None and not self.agree(match.reuse_tokens if match else 0):
            return None
        if match is None:
            return None
        snapshot = self.cache.load(match)
        if self.agree is not None and not self.agree(int(snapshot is not None)):
            return None
        return (match, snapshot) if snapshot is not None else None

    def positions(
        self,
        key: str,
        prompt: RenderedPrompt,
        align: Callable[[int], int],
        scope: DiskScope | None,
    ) -> set[int]:
        """Positions of this prompt to persist (records the request for `auto`, whose
        window of recent requests is per entry key: what one namespace sends never
        decides what another's saves)."""
        return set(self.policy.select(key, prompt, align, scope, trimmable=self.trimmable))

    def defer(
        self, key: str, tokens: Sequence[int], snapshot: Snapshot, kind: CheckpointKind
    ) -> None:
        """Queue a save (engine thread). A full queue first writes its oldest save."""
        if len(self._pending) >= MAX_PENDING_SAVES:
            self._write(self._pending.popleft())
        save = _PendingSave(key, TokenIds(tokens), snapshot, kind, time.monotonic())
        self._pending.append(save)
        self._account()

    def write_pending(self, busy: bool, decoding: bool = False) -> None:
        """Write one queued save: the oldest when idle, only an overdue one when busy,
        none while requests are `decoding` (the bounded queue still writes its oldest
        when full). One per engine turn, so a request that arrives meanwhile waits for
        one file at most."""
        if not self.due(busy, decoding):
            return
        self._write(self._pending.popleft())
        self._account()

    def due(self, busy: bool, decoding: bool = False) -> bool:
        """Whether `write_pending(busy, decoding)` writes a save now. Does not mutate."""
        if not self._pending or decoding:
            return False
        return not busy or time.monotonic() - self._pending[0].queued_at >= MAX_SAVE_DELAY_S

    def drop(self, tokens_len: int, why: str) -> None:
        """Log a save that cannot happen (engine thread)."""
        self.dropped += 1
        log.warning("disk save of a %d-token prefix dropped: %s", tokens_len, why)

    def drop_pending(self, why: str) -> None:
        """Give up every queued save, with a log line each (engine thread)."""
        while self._pending:
            self.drop(len(self._pending.popleft().tokens), why)
        self._account()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _write(self, item: _PendingSave) -> None:
        self.cache.save(item.key, item.tokens, item.snapshot, item.kind)

    def _account(self) -> None:
        """Report what the queued snapshots keep alive: their buffers, each once, those
        stored entries hold too counted as the entries' (a queued checkpoint's chain
        shares the stored turns' pieces: cache/chain.py)."""
        held = {b.key: b for p in self._pending for b in buffers_of(p.snapshot)}
        if held:
            nbytes = sum(b.nbytes for b in held.values())
            self.store.set_active_bytes(self._bytes_key, nbytes, tuple(held.values()))
        else:
            self.store.drop_active(self._bytes_key)
