"""Immutable captures of a request's per-layer cache, restored copy-on-write.

Besides `disk/payload.py` and the per-class kinds it asks (cache/layers/: what each
cache class keeps, captures and restores), the only cache module that touches MLX.
Why sharing is safe (invariant 2):
- MLX arrays are values: `x[a:b] = y` builds a new array and rebinds that one
  Python object to it. It writes into the old buffer only when that buffer is
  donatable (no other array or view references it). A snapshot's arrays are
  referenced by the snapshot, so no cache that shares them can write into them.
- What is NOT safe is two holders of the same Python `mx.array` object: a slice
  assignment through one rebinds what the other sees. So capture and restore
  always hand out fresh array objects (slices/views: no copy).
- KV buffers are sliced to exactly `offset` tokens, so a restored KVCache's first
  `update_and_fetch` reallocates (concatenate) instead of writing in place, and a
  snapshot does not keep the step padding in its accounting.

Memory: a view keeps its whole buffer alive, and a live KVCache's buffer is
step-padded (up to `KVCache.step - 1` tokens per layer past its offset). So a
snapshot's `nbytes` counts the buffers it keeps alive, not just the tokens it
covers: the byte budget holds what is really resident (invariant 6). Recurrent state
arrays can be views of a whole chunk's input (Nemotron-H's conv state): they are
copied down to their own size.

Checkpoints of one prefill share its attention KV (`capture_deferred` + `complete`):
a view taken mid-prefill would pin that moment's buffer, and the next write would
copy it (MLX writes in place only into a buffer nothing else references), so every
checkpoint would hold its own copy of the prefix: memory quadratic in checkpoint
density. Instead a checkpoint at p captures at once only the layers whose state
changes in place (recurrent, rotating), and binds its append-only KV layers when
the prefill ends, to views [:p] of the final buffers. Their first p positions are
the very bits the cache held at p (appends never rewrite earlier positions; growth
copies them), so a restore is exact, and all of the prefill's checkpoints hold one
KV buffer, listed in `buffers` under one key so the store counts it once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from mlx_prefix.cache.layers import CacheListKind, LayerSnapshot, kind_of
from mlx_prefix.cache.layers.base import arrays_in
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


def with_draft(snapshot: Snapshot, draft: Snapshot) -> Snapshot:
    """`snapshot` carrying the draft model's capture of the same prefix."""
    assert draft.length == snapshot.length and draft.draft is None
    own = snapshot.buffers or (Buffer(new_buffer_key(), snapshot.nbytes),)
    extra = draft.buffers or (Buffer(new_buffer_key(), draft.nbytes),)
    return replace(
        snapshot, nbytes=snapshot.nbytes + draft.nbytes, buffers=own + extra, draft=draft
    )


@dataclass(frozen=True, slots=True)
class PendingSnapshot:
    """A checkpoint taken mid-prefill whose append-only KV layers are bound later
    (`complete`); its other layers are captured."""

    length: int
    trimmable: bool
    layers: tuple[LayerSnapshot | None, ...]  # None: an append-only KV layer, bound later
    nbytes: int  # of the captured layers


def capture(cache: list[Any], length: int) -> Snapshot:
    """Capture `cache` after `length` tokens. Does not mutate `cache`.

    The snapshot holds views of the cache's buffers (no copy); the cache keeps
    working, and its later writes never reach the snapshot. Raises ValueError if a
    KV layer's offset is not `length` (a checkpoint taken at the wrong position).
    """
    layers = tuple(_capture_layer(c, length) for c in cache)
    arrays = _arrays(layers)
    mx.eval(arrays)
    # The views keep the cache's whole (step-padded) buffers alive.
    nbytes = max(sum(a.nbytes for a in arrays), cache_nbytes(cache))
    return Snapshot(
        length=length,
        trimmable=is_trimmable(cache),
        nbytes=nbytes,
        layers=layers,
        buffers=(Buffer(new_buffer_key(), nbytes),),
    )


def capture_deferred(cache: list[Any], length: int) -> PendingSnapshot:
    """Capture `cache` after `length` tokens, except its append-only KV layers, which
    `complete` binds to the buffers the cache holds then. Does not mutate `cache`.
    The caller must not trim, rewind or replace those layers before `complete`."""
    layers = tuple(_defer_layer(c, length) for c in cache)
    arrays = _arrays(layers)
    mx.eval(arrays)
    return PendingSnapshot(length, is_trimmable(cache), layers, sum(a.nbytes for a in arrays))


def kv_buffer(cache: list[Any]) -> Buffer:
    """The append-only KV buffers `cache` holds now, as one new Buffer (what the
    checkpoints `complete`d from it share). Does not mutate."""
    return Buffer(new_buffer_key(), sum(_append_only_nbytes(c) for c in cache))


def complete(pending: PendingSnapshot, cache: list[Any], kv: Buffer) -> Snapshot:
    """The Snapshot of `pending`: its deferred KV layers become views [:length] of
    `cache`'s current buffers (described by `kv`, from `kv_buffer(cache)`). Does not
    mutate `pending` or `cache`."""
    layers = tuple(
        _complete_layer(x, c, pending.length) for x, c in zip(pending.layers, cache, strict=True)
    )
    mx.eval(_arrays(layers))
    own = Buffer(new_buffer_key(), pending.nbytes)
    buffers = (kv, own) if kv.nbytes else (own,)
    return Snapshot(pending.length, pending.trimmable, kv.nbytes + own.nbytes, layers, buffers)


def restore(snapshot: Snapshot, trim: int = 0) -> list[Any]:
    """Fresh cache objects holding `snapshot.length - trim` tokens. Does not mutate
    `snapshot`.

    The new caches share the snapshot's buffers (no copy: time and memory are flat
    in the prefix length); whatever the caller does with them leaves the snapshot
    unchanged. `trim` > 0 needs a trimmable snapshot (ValueError otherwise).
    """
    if not 0 <= trim <= snapshot.length:
        raise ValueError(f"trim {trim} outside 0..{snapshot.length}")
    if trim and not snapshot.trimmable:
        raise ValueError("cannot trim a non-trimmable snapshot")
    cache = [_restore_layer(layer, trim) for layer in snapshot.layers]
    mx.eval([a for c in cache for a in _cache_arrays(c)])
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


def _capture_layer(c: Any, length: int) -> LayerSnapshot:
    return kind_of(c).capture(c, length)


def _append_only(c: Any) -> bool:
    return kind_of(c).append_only and c.keys is not None


def _append_only_nbytes(c: Any) -> int:
    if isinstance(kind_of(c), CacheListKind):
        return sum(_append_only_nbytes(x) for x in c.caches)
    return c.nbytes if _append_only(c) else 0


def _defer_layer(c: Any, length: int) -> LayerSnapshot | None:
    if isinstance(kind_of(c), CacheListKind):
        children = tuple(_defer_layer(x, length) for x in c.caches)
        return LayerSnapshot(type(c), (), children)  # type: ignore[arg-type]
    if _append_only(c):
        if c.offset != length:
            raise ValueError(f"{type(c).__name__} offset {c.offset} != checkpoint length {length}")
        return None
    return _capture_layer(c, length)


def _complete_layer(x: LayerSnapshot | None, c: Any, length: int) -> LayerSnapshot:
    if x is None:
        assert _append_only(c) and c.offset >= length, "deferred KV layer rewound"
        return LayerSnapshot(type(c), kind_of(c).keeping(c, length))
    if x.children:
        children = zip(x.children, c.caches, strict=True)
        return LayerSnapshot(x.cls, (), tuple(_complete_layer(y, z, length) for y, z in children))
    return x


def _restore_layer(layer: LayerSnapshot, trim: int) -> Any:
    return kind_of(layer.cls).restore(layer, trim)


def _arrays(layers: tuple[LayerSnapshot | None, ...]) -> list[mx.array]:
    out: list[mx.array] = []
    for layer in layers:
        if layer is None:
            continue
        out.extend(arrays_in(list(layer.state)))
        out.extend(_arrays(layer.children))
    return out


def _cache_arrays(c: Any) -> list[mx.array]:
    return kind_of(c).arrays(c)
