"""Immutable captures of a request's per-layer cache, restored copy-on-write.

Besides `disk/payload.py`, `chain` and the per-class kinds it asks (cache/layers/: what each
cache class keeps, captures and restores), the only cache module that touches MLX.

What a snapshot holds: its append-only attention KV as a chain of pieces (chain.py: the
parent's pieces plus one for what this request computed since, so each token's KV is
stored once across a conversation's entries), and every other layer's state at its
end (recurrent, rotating: fixed-size) as views or copies of the live layer. Its
`buffers` are the pieces' and one of its own for that state: the store counts each
once, so a piece that several entries share counts once, and removing an entry frees
only what no other entry holds (a parent whose children build on its piece frees its
own state: the piece stays theirs).

Why sharing is safe (invariant 2):
- MLX arrays are values: `x[a:b] = y` builds a new array and rebinds that one
  Python object to it. It writes into the old buffer only when that buffer is
  donatable (no other array or view references it). A snapshot's arrays are
  referenced by the snapshot, so no cache that shares them can write into them.
- What is NOT safe is two holders of the same Python `mx.array` object: a slice
  assignment through one rebinds what the other sees. So capture and restore
  always hand out fresh array objects (slices/views/copies).
- Pieces are copies exactly as long as what they hold (no step padding); a restored
  KV layer's buffer is a new concatenation of them (or, for one piece and no room, a
  view exactly offset long, whose first `update_and_fetch` reallocates), so nothing a
  request writes reaches a piece.

Memory: a view keeps its whole buffer alive (a rotating layer's ring), so a snapshot's
`nbytes` counts the buffers it keeps alive, not just the tokens it covers: the byte
budget holds what is really resident (invariant 6). Recurrent state arrays can be views
of a whole chunk's input (Nemotron-H's conv state): they are copied down to their own
size.

Checkpoints of one prefill each cut a piece at their boundary (what the prefill computed
since the last one), so they share their KV as a chain too; a checkpoint never views
the live buffer, which would pin that moment's buffer and make the next write copy it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from mlx_prefix.cache.chain import Chain, Piece, assemble, chained, extend, whole
from mlx_prefix.cache.layers import LayerSnapshot, kind_of, layers_of
from mlx_prefix.cache.layers.base import arrays_in, stash
from mlx_prefix.cache.types import Buffer, new_buffer_key


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Immutable capture of a per-layer cache list at `length` tokens."""

    length: int  # tokens the captured cache had processed
    trimmable: bool  # every layer could drop tokens from its end
    nbytes: int  # bytes it keeps alive (the sum of `buffers`)
    layers: tuple[LayerSnapshot, ...]  # one per model layer
    buffers: tuple[Buffer, ...] = ()  # what it keeps alive; () = one buffer of its own
    # Speculative decoding: the draft model's cache at the same `length` (counted in
    # `nbytes` and `buffers`); restored beside the target's (engine/decode/speculative.py).
    draft: Snapshot | None = None
    # The KV of its layers with a `slot`, positions [0, length) (() for a snapshot whose
    # layers hold their whole state).
    chain: Chain = Chain()


def capture(cache: list[Any], length: int, chain: Chain | None = None) -> Snapshot:
    """Capture `cache` after `length` tokens. Does not mutate `cache`.

    `chain`: pieces already holding the cache's first positions (the entry it was
    restored from, the checkpoints it stored since); the capture adds one piece copied
    from the cache for the rest (none without a chain: one piece of everything). The
    other layers' state is held as views (or copies: recurrent state); the cache keeps
    working, and its later writes never reach the snapshot. Raises ValueError if a KV
    layer's offset is not `length` (a checkpoint taken at the wrong position).
    """
    chain = extend(chain or Chain(), cache, length)
    slots = iter(range(len(chain.forms)))
    layers = tuple(_capture_layer(c, length, slots) for c in cache)
    arrays = _arrays(layers)
    mx.eval(arrays)
    # Views keep the live layers' whole buffers alive (a rotating layer's ring).
    state = max(sum(a.nbytes for a in arrays), _unchained_nbytes(cache))
    return _snapshot(length, is_trimmable(cache), layers, chain, state)


def _snapshot(
    length: int, trimmable: bool, layers: tuple[LayerSnapshot, ...], chain: Chain, state: int
) -> Snapshot:
    own = (Buffer(new_buffer_key(), state),) if state or not chain.pieces else ()
    buffers = (*chain.buffers, *own)
    return Snapshot(length, trimmable, sum(b.nbytes for b in buffers), layers, buffers, None, chain)


def with_draft(snapshot: Snapshot, draft: Snapshot) -> Snapshot:
    """`snapshot` carrying the draft model's capture of the same prefix."""
    assert draft.length == snapshot.length and draft.draft is None
    own = snapshot.buffers or (Buffer(new_buffer_key(), snapshot.nbytes),)
    extra = draft.buffers or (Buffer(new_buffer_key(), draft.nbytes),)
    return replace(
        snapshot, nbytes=snapshot.nbytes + draft.nbytes, buffers=own + extra, draft=draft
    )


def shortened(snapshot: Snapshot, n: int) -> Snapshot | None:
    """The first `n` tokens of a trimmable `snapshot` whose every layer is in its chain,
    sharing its pieces (no copy, no compute); None for any other snapshot."""
    if not snapshot.trimmable or snapshot.draft is not None or _arrays(snapshot.layers):
        return None
    if not snapshot.chain.pieces or any(x.slot < 0 for x in _leaves(snapshot.layers)):
        return None
    chain = snapshot.chain.upto(n)
    return Snapshot(n, True, chain.nbytes, snapshot.layers, chain.buffers, None, chain)


def from_whole(snapshot: Snapshot) -> Snapshot:
    """`snapshot` (its layers holding their whole state: read from disk) with its KV layers
    moved into a chain of one piece, sharing its arrays (no copy), so that requests
    restored from it chain their own pieces onto it."""
    if snapshot.chain.pieces or snapshot.draft is not None:
        return snapshot
    n = snapshot.length
    parts: list[tuple[mx.array, ...]] = []
    forms: list[type] = []

    def move(layer: LayerSnapshot) -> LayerSnapshot:
        if layer.children:
            return replace(layer, children=tuple(move(x) for x in layer.children))
        kind = kind_of(layer.cls)
        if not kind.chained or not kind.holds(layer.state, n):
            return layer
        arrays, rest = kind.split(layer.state)
        parts.append(tuple(a[..., :n, :] for a in arrays))
        forms.append(layer.cls)
        return LayerSnapshot(layer.cls, rest, slot=len(parts) - 1)

    layers = tuple(move(x) for x in snapshot.layers)
    if not parts:
        return snapshot
    mx.eval([a for p in parts for a in p])
    kv = sum(a.nbytes for p in parts for a in p)
    piece = Piece(0, n, tuple(parts), tuple(forms), Buffer(new_buffer_key(), kv))
    state = sum(a.nbytes for a in _arrays(layers))
    return _snapshot(n, snapshot.trimmable, layers, Chain((piece,)), state)


def whole_layers(snapshot: Snapshot) -> tuple[LayerSnapshot, ...]:
    """`snapshot`'s layers with their whole state, chained KV concatenated (lazy: a disk
    save evaluates one array at a time). Does not mutate."""

    def fill(layer: LayerSnapshot) -> LayerSnapshot:
        if layer.children:
            return replace(layer, children=tuple(fill(x) for x in layer.children))
        if layer.slot < 0:
            return layer
        kind = kind_of(layer.cls)
        arrays = whole(snapshot.chain.parts(layer.slot))
        return LayerSnapshot(layer.cls, kind.join(arrays, snapshot.length, layer.state))

    return tuple(fill(x) for x in snapshot.layers)


def restore(snapshot: Snapshot, trim: int = 0, extend: int = 0) -> list[Any]:
    """Fresh cache objects holding `snapshot.length - trim` tokens. Does not mutate
    `snapshot`.

    Other layers share the snapshot's buffers (views); KV layers get the chain's pieces
    one after the other (chain.py `assemble`), lazily, with room for a first append of
    `extend` tokens (0: none), so that append evaluates the one copy of the prefix a
    whole snapshot's first append made, and writes in place. Whatever the caller does
    with them leaves the snapshot unchanged. `trim` > 0 needs a trimmable snapshot
    (ValueError otherwise).
    """
    if not 0 <= trim <= snapshot.length:
        raise ValueError(f"trim {trim} outside 0..{snapshot.length}")
    if trim and not snapshot.trimmable:
        raise ValueError("cannot trim a non-trimmable snapshot")
    n = snapshot.length - trim
    chain = snapshot.chain.upto(n) if snapshot.chain.pieces else snapshot.chain
    views: list[mx.array] = []  # evaluated now; a concatenation is left to the first append
    cache = [_restore_layer(x, trim, chain, n, extend, views) for x in snapshot.layers]
    mx.eval(views)
    return cache


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes of a per-layer cache list (mlx-lm's `nbytes`). Does not mutate."""
    return sum(c.nbytes for c in cache)


def is_trimmable(cache: list[Any]) -> bool:
    """Whether every layer can drop tokens from its end. Does not mutate.

    Quantized KV counts as not trimmable: positions below --quantized-kv-start are
    float in a cold run, so a quantized state restores only exactly
    (engine/forward/kv_quant.py).
    """
    return all(c.is_trimmable() and not kind_of(c).exact_only for c in cache)


def _capture_layer(c: Any, length: int, slots: Iterator[int]) -> LayerSnapshot:
    if isinstance(c, CacheList):
        return LayerSnapshot(type(c), (), tuple(_capture_layer(x, length, slots) for x in c.caches))
    if chained(c):  # its KV is in the chain (`extend` checked its offset)
        return LayerSnapshot(type(c), kind_of(c).split(c.state)[1], slot=next(slots))
    return kind_of(c).capture(c, length)


def _unchained_nbytes(cache: list[Any]) -> int:
    return sum(c.nbytes for c in layers_of(cache) if not chained(c))


def _restore_layer(
    layer: LayerSnapshot, trim: int, chain: Chain, n: int, extend: int, views: list[mx.array]
) -> Any:
    if layer.children:
        children = (_restore_layer(x, trim, chain, n, extend, views) for x in layer.children)
        return layer.cls(*children)
    kind = kind_of(layer.cls)
    if layer.slot < 0:
        restored = kind.restore(layer, trim)
        views.extend(_cache_arrays(restored))
        return restored
    parts = chain.parts(layer.slot)
    room = kind.room(layer.cls, n, extend)
    arrays = assemble(parts, room)
    restored = layer.cls.from_state(kind.join(arrays, n, layer.state))
    if len(parts) > 1 or room:
        stash(restored, parts)  # a merge copies these, not the concatenation (layers/kv.py)
    else:
        views.extend(arrays)
    return restored


def _leaves(layers: tuple[LayerSnapshot, ...]) -> list[LayerSnapshot]:
    out: list[LayerSnapshot] = []
    for layer in layers:
        out.extend(_leaves(layer.children) if layer.children else [layer])
    return out


def _arrays(layers: tuple[LayerSnapshot, ...]) -> list[mx.array]:
    out: list[mx.array] = []
    for layer in layers:
        out.extend(arrays_in(list(layer.state)))
        out.extend(_arrays(layer.children))
    return out


def _cache_arrays(c: Any) -> list[mx.array]:
    return kind_of(c).arrays(c)
