"""An entry handed to the request that extends it, and its longer entry handed back (MLX).

Under a tight budget a conversation's next turn cannot hold its stored entry beside the
live copy its cache makes of it (issue 55: at 190 MiB an 88 MiB conversation missed
every turn: the copy evicted the entry, then the longer entry was refused). So the
store hands the entry over (`PromptCache.hand_over`): the request's cache becomes the
only copy of those tokens, and the entry's pieces are freed as soon as the restore has
copied them (`settle`). The end of its prompt (of any request's, when the budget cannot
hold the piece beside the live cache: a conversation's first turn) is not cut into a
piece of its own at the end of prefill (a second copy while the cache decodes on), and
no other checkpoint is cut that the budget cannot hold beside it; when it finishes,
its decode row's first positions become the entry (`row_snapshot`): a lone row's
buffer is kept as it is (views, no copy: the batch lets go of it), a row among others
is copied out, as a checkpoint's piece is. Either way the KV is what the prefill wrote
(decode appends after it), so a hit on it is exact.

Hybrid models (attention KV beside recurrent or rotating layers) go the same way: only
their KV moves through the row; the other layers' state at the prompt's end is captured
when the prefill reaches it (`states_at`: fixed-size, a copy of exactly that state, what
a checkpoint there would hold) and joined to the row's KV at the end. An entry the
request restores is an exact checkpoint, whether the prompt extends it or only shares
it (a chat template that re-renders the reply: the turn restores the checkpoint at the
previous prompt's end, a prefix of the longer entry beside it); either is handed over.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache

from mlx_prefix.cache.chain import Chain, Piece
from mlx_prefix.cache.layers import LayerSnapshot, kind_of
from mlx_prefix.cache.layers.base import arrays_in, unstash
from mlx_prefix.cache.snapshot import Snapshot, capture
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.types import Buffer, CheckpointKind, new_buffer_key


@dataclass(frozen=True, slots=True)
class EndState:
    """A hybrid cache's non-KV layers at a checkpoint (None where a layer is KV, which the
    decode row gives), in a buffer of their own."""

    length: int  # the checkpoint's position
    kind: CheckpointKind
    layers: tuple[LayerSnapshot | None, ...]
    buffer: Buffer


def _fixed(layer_cls: type) -> bool:
    """A layer class whose whole state is captured as is (recurrent, rotating)."""
    return not issubclass(layer_cls, CacheList) and not kind_of(layer_cls).chained


def plain_kv(snapshot: Any) -> bool:
    """Whether `snapshot` may be handed over: its attention layers KVCache in its chain,
    any others fixed-size state held whole (recurrent, rotating), no draft."""
    if not isinstance(snapshot, Snapshot) or snapshot.draft is not None:
        return False
    if not snapshot.chain.pieces:
        return False
    for x in snapshot.layers:
        if x.children or (x.slot >= 0 and x.cls is not KVCache):
            return False
        if x.slot < 0 and not _fixed(x.cls):
            return False
    return True


def plain_kv_cache(cache: list[Any]) -> bool:
    """Whether a live cache is KVCache layers, and maybe fixed-size ones beside (what
    `row_snapshot` reads back with `states_at`)."""
    return bool(_kv(cache)) and all(type(c) is KVCache or _fixed(type(c)) for c in cache)


def _kv(cache: list[Any]) -> list[Any]:
    """The KVCache layers of a live cache, in order."""
    return [c for c in cache if type(c) is KVCache]


def hybrid(cache: list[Any]) -> bool:
    """Whether a live cache has layers besides KVCache."""
    return any(type(c) is not KVCache for c in cache)


def at_offset(cache: list[Any], length: int) -> bool:
    """Whether a live cache's KV layers hold exactly `length` positions."""
    return all(c.offset == length for c in _kv(cache))


def kv_bytes(cache: list[Any], tokens: int) -> int:
    """Bytes `tokens` positions of a live cache's KV layers take (keys and values, every
    layer): what a piece of that many positions would copy."""
    total = 0
    for c in _kv(cache):
        if c.keys is not None and c.keys.shape[2]:
            total += (c.keys.nbytes + c.values.nbytes) * tokens // c.keys.shape[2]
    return total


def kv_growth(cache: list[Any], rest: int) -> int:
    """Bytes a live cache's KV buffers may still grow by while its prefill appends `rest`
    more positions: none where the buffer already holds them (mlx-lm's KVCache grows by
    steps of `KVCache.step` positions, so it often does), else what it lacks and a step
    less one of padding (a growth leaves the buffer less than a step past its offset)."""
    total = 0
    for c in _kv(cache):
        if c.keys is None or not c.keys.shape[2]:
            continue  # nothing to size a position by: an empty cache's first chunk sizes it
        lacking = c.offset + rest - c.keys.shape[2]
        if lacking > 0:
            per_position = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            total += per_position * (lacking + KVCache.step - 1)
    return total


def room_needed(cache: list[Any], piece: int, rest: int, end_copied: bool = True) -> int:
    """What a checkpoint cut from a live cache now adds: `piece` positions of its KV; for
    a hybrid cache its other layers' state too, what its KV buffers still grow by for
    the `rest` positions its prefill appends (`kv_growth`), and, where the checkpoint is
    not the prompt's end (`rest` > 0) and the end's state will be a copy beside the live
    one (`end_copied`: a request that decodes on; a cancelled one's end is its live
    cache's, let go of), that state too (the one the next turn needs)."""
    need = kv_bytes(cache, piece)
    if hybrid(cache):
        state = sum(c.nbytes for c in cache if type(c) is not KVCache)
        need += kv_growth(cache, rest) + (2 if rest > 0 and end_copied else 1) * state
    return need


def states_at(
    cache: list[Any], length: int, kind: CheckpointKind = CheckpointKind.HISTORY
) -> EndState:
    """The non-KV layers of a live cache at `length` tokens (its KV layers' offset), as
    a checkpoint there captures them. Does not mutate `cache`."""
    layers = tuple(None if type(c) is KVCache else kind_of(c).capture(c, length) for c in cache)
    arrays = [a for x in layers if x is not None for a in arrays_in(list(x.state))]
    mx.eval(arrays)
    nbytes = sum(a.nbytes for a in arrays)
    return EndState(length, kind, layers, Buffer(new_buffer_key(), nbytes))


def settle(cache: list[Any]) -> None:
    """A cache restored from a handed-over entry: evaluate its copy of the pieces now and
    forget them (a merge would read them instead), so they are freed at once."""
    kv = _kv(cache)
    mx.eval([a for c in kv for a in (c.keys, c.values) if a is not None])
    for c in kv:
        unstash(c)


def row_snapshot(
    batch: list[Any], row: int, length: int, lone: bool, state: EndState | None = None
) -> Snapshot:
    """The first `length` positions of decode row `row` of a batch cache (mlx-lm's
    BatchKVCache per KV layer), as a snapshot; the other layers from `state` (the
    prompt's end: the row went on past it). `lone`: the row is the batch's only one and
    the batch lets go of its buffers: the snapshot views them (no copy; it keeps them
    alive whole, counted so). Otherwise the positions are copied."""
    kv = [i for i in range(len(batch)) if state is None or state.layers[i] is None]
    live: list[Any] = []
    for i in kv:
        layer = batch[i]
        pad = int(layer.left_padding[row].item())
        c = KVCache()
        c.keys = layer.keys[row : row + 1, :, pad : pad + length, :]
        c.values = layer.values[row : row + 1, :, pad : pad + length, :]
        c.offset = length
        live.append(c)
    if not lone:
        return _joined(capture(live, length), state)  # a piece cut from the row: a copy
    held = sum(batch[i].keys.nbytes + batch[i].values.nbytes for i in kv)
    return _joined(_viewed(live, length, held), state)


def live_snapshot(cache: list[Any], length: int) -> Snapshot:
    """The first `length` positions of a live cache its request lets go of (a cancelled
    one's, whose end was left to a decode row it never reached), as views: no copy; the
    snapshot keeps its buffers alive whole, counted so. Its other layers (hybrid) as
    they are now: the caller checks the cache is at `length`."""
    live: list[Any] = []
    for layer in _kv(cache):
        c = KVCache()
        c.keys = layer.keys[..., :length, :]
        c.values = layer.values[..., :length, :]
        c.offset = length
        live.append(c)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in _kv(cache))
    state = states_at(cache, length) if hybrid(cache) else None
    return _joined(_viewed(live, length, held), state)


def from_row(end: Snapshot, state: EndState) -> Snapshot:
    """The checkpoint `state` of a request, its KV the first positions of `end`'s chain
    (the entry its row gave back: views, no copy; counted once with it)."""
    chain = end.chain.upto(state.length)
    layers = tuple(x for x in end.layers if x.slot >= 0)
    part = Snapshot(state.length, False, chain.nbytes, layers, chain.buffers, None, chain)
    return _joined(part, state)


def keep_inside(
    store: PromptCache, key: str, tokens: Sequence[int], end: Snapshot, states: Iterable[EndState]
) -> list[int]:
    """Store the checkpoints `states` shorter than `end`, their KV `end`'s first positions
    (`from_row`); the positions stored. Mutates the store."""
    stored = []
    for state in states:
        if state.length < end.length:
            snapshot = from_row(end, state)
            if store.insert(key, tokens[: state.length], snapshot, state.kind):
                stored.append(state.length)
    return stored


def _viewed(live: list[Any], length: int, held: int) -> Snapshot:
    """A snapshot of `live`'s views as one piece keeping `held` bytes alive."""
    parts = tuple((c.keys, c.values) for c in live)
    mx.eval([a for p in parts for a in p])
    piece = Piece(0, length, parts, tuple(KVCache for _ in live), Buffer(new_buffer_key(), held))
    return capture(live, length, Chain((piece,)))


def _joined(kv: Snapshot, state: EndState | None) -> Snapshot:
    """`kv` (a snapshot of a cache's KV layers only) with the other layers' `state`
    in their places: the whole cache's snapshot, holding `state`'s buffer too."""
    if state is None:
        return kv
    slotted = iter(kv.layers)
    layers = tuple(next(slotted) if x is None else x for x in state.layers)
    buffers = (*kv.buffers, state.buffer)
    nbytes = sum(b.nbytes for b in buffers)
    return Snapshot(kv.length, False, nbytes, layers, buffers, None, kv.chain)
