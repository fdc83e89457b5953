"""The prompt cache's types: checkpoint kinds, buffers, payloads, and its result records.

Apart from the store (`store.PromptCache`, which returns these records) so that the
eviction policy, the disk tier and the prompt planner can name a CheckpointKind
without the store. Pure Python (no MLX).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Generic, Protocol, TypeVar


class CheckpointKind(IntEnum):
    """Why a checkpoint was taken. Eviction order (`eviction.KindLRU`): lower is evicted
    first. Disk files record the name, never the number."""

    # Where a cancelled prefill stopped (or what it stored running on once its client
    # had gone: engine/loop.py): exact like every other, but nobody asked for it, so it
    # goes before every other kind and never pushes one out (eviction/policy.py).
    CANCELLED = 0
    PERIODIC = 1
    HISTORY = 2
    LAST_MESSAGE = 3
    BREAKPOINT = 4  # the client marked the prefix up to here stable (`cache_control`)
    SYSTEM = 5
    # No kind for the post-generation state: a decode state is never cached (invariant
    # 12); the next-turn prefetch prefills the reply again instead.


@dataclass(frozen=True, slots=True)
class Buffer:
    """Memory a payload keeps alive. Several payloads may hold the same buffer (the
    checkpoints of one prefill share its attention KV); the store counts each once."""

    key: int  # identifies the buffer (`new_buffer_key()`): equal keys, same memory
    nbytes: int


_buffer_keys = itertools.count(1)


def new_buffer_key() -> int:
    """A key no buffer has had before (thread-safe)."""
    return next(_buffer_keys)


def covers(selector: str, key: str) -> bool:
    """Whether a listing or flush by `selector` includes the entries of `key`: the same
    key, or one nested under it (`selector + "/..."`; engine/keys.py builds them: a
    model's key covers each of its namespaces, a namespace's key each salt in it).
    Lookups and inserts never use this: they take exactly one key."""
    return key == selector or key.startswith(selector + "/")


class Payload(Protocol):
    """What the store reads of a payload; one with a `buffers` attribute (a tuple of
    Buffer, summing to `nbytes`) shares them with others, one without holds its own."""

    @property
    def nbytes(self) -> int: ...
    @property
    def trimmable(self) -> bool: ...
    @property
    def length(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CacheMatch:
    entry_id: int | None  # entry to restore (None: miss)
    reuse_tokens: int  # tokens the request gets from the cache (after trim/alignment); 0 on miss
    trim: int  # tokens to drop from the entry's end when restoring
    matched_tokens: int  # longest common prefix with any stored sequence (diagnostic)
    kind: CheckpointKind | None = None  # the entry's kind (None: miss)


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int  # match() calls that found a usable entry
    misses: int  # match() calls that did not
    tokens_reused: int  # sum of reuse_tokens over hits
    entries: int  # stored checkpoints
    bytes: int  # bytes of stored checkpoints
    bytes_by_kind: dict[str, int]  # CheckpointKind name -> bytes
    entries_by_kind: dict[str, int]  # CheckpointKind name -> count
    active_bytes: int  # bytes running requests hold besides what stored entries hold
    active_requests: int  # requests with reported bytes
    evictions: int  # entries evicted for budget or count (not clear())
    budget_bytes: int  # the one budget covering bytes + active_bytes
    pinned: int  # stored entries that are pinned
    locked: int  # stored entries acquired and not yet released
    # entries given to the request that extends them, when the budget could not hold both
    # copies (its end stores the longer entry in their place: not an eviction)
    handed_over: int = 0
    peak_bytes: int = 0  # most bytes + active_bytes after any change: the budget as a cap


@dataclass(frozen=True, slots=True)
class EntryInfo:
    entry_id: int
    model_key: str
    tokens: int  # sequence length
    nbytes: int
    kind: CheckpointKind
    trimmable: bool
    hits: int  # times acquired
    age_s: float  # since insertion
    idle_s: float  # since the last insert/acquire
    pinned: bool
    refs: int  # current locks
    shared_bytes: int = 0  # of `nbytes`, in buffers other entries hold too


Info = TypeVar("Info")


@dataclass(frozen=True, slots=True)
class StoredTokens(Generic[Info]):
    """A stored entry's record (EntryInfo, or the disk tier's DiskEntryInfo) with the token
    ids it covers: a reference to the stored immutable tuple, never a copy."""

    info: Info
    tokens: tuple[int, ...]


class EvictOutcome(Enum):
    """What `PromptCache.evict_entry` did."""

    EVICTED = "evicted"
    MISSING = "missing"  # no such entry (of that model key)
    LOCKED = "locked"  # a running request is restoring from it
    PINNED = "pinned"  # unpin it first
