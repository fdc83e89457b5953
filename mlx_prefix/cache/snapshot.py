"""Immutable captures of a request's per-layer cache, restored copy-on-write.

Besides `disk_payload`, the only cache module that touches MLX. Why sharing is safe (invariant 2):
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
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlx_prefix.cache.records import Buffer, new_buffer_key


@dataclass(frozen=True, slots=True)
class LayerSnapshot:
    cls: type  # the cache class to rebuild (through its `from_state`)
    state: tuple[Any, ...]  # its `state`, arrays as the snapshot's own objects, KV sliced to offset
    children: tuple[LayerSnapshot, ...] = ()  # CacheList members (then `state` is empty)


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
    float in a cold run, so a quantized state restores only exactly (engine/forward/kv_quant.py).
    """
    return all(c.is_trimmable() and not isinstance(c, QuantizedKVCache) for c in cache)


# -- per class ----------------------------------------------------------------
#
# Positions kept per class (n = tokens kept):
#   KVCache, ConcatenateKVCache  keys[..., :n, :]                    offset = n
#   QuantizedKVCache            each of (packed, scales, biases)[..., :n, :]
#   ChunkedKVCache              keys[..., :n - start_position, :]    offset = n
#   RotatingKVCache, unwrapped  keys[..., :n, :], _idx = n  (temporal order while offset < max_size)
#   RotatingKVCache, wrapped    whole ring buffer as is (not trimmable)
#   ArraysCache                 every state array as is (not trimmable)


_KV_CLASSES = (KVCache, ConcatenateKVCache, QuantizedKVCache, ChunkedKVCache, RotatingKVCache)


def _view(a: Any) -> Any:
    """A fresh array object over the same buffer (or `a` if not an array)."""
    return a[...] if isinstance(a, mx.array) else a


def _head(x: Any, n: int) -> Any:
    return x[..., :n, :]


def _check_offset(c: Any, length: int) -> None:
    if c.offset != length:
        raise ValueError(f"{type(c).__name__} offset {c.offset} != checkpoint length {length}")


def _capture_layer(c: Any, length: int) -> LayerSnapshot:
    cls = type(c)
    if isinstance(c, CacheList):
        return LayerSnapshot(cls, (), tuple(_capture_layer(x, length) for x in c.caches))
    if isinstance(c, _KV_CLASSES):
        _check_offset(c, length)
        if c.keys is None:
            return LayerSnapshot(cls, tuple(c.state))
        return LayerSnapshot(cls, _kv_state(c, c.offset))
    if isinstance(c, ArraysCache):
        arrays, left_padding, lengths = c.state
        # Copied down to their own size when they are views of a larger buffer.
        own = tuple(mx.contiguous(a) if isinstance(a, mx.array) else a for a in arrays)
        return LayerSnapshot(cls, (own, _view(left_padding), _view(lengths)))
    return LayerSnapshot(cls, tuple(tree_map(_view, c.state)))


# Layers that only ever append: positions below the offset never change once written.
_APPEND_ONLY = (KVCache, QuantizedKVCache, ConcatenateKVCache)


def _append_only(c: Any) -> bool:
    return type(c) in _APPEND_ONLY and c.keys is not None


def _append_only_nbytes(c: Any) -> int:
    if isinstance(c, CacheList):
        return sum(_append_only_nbytes(x) for x in c.caches)
    return c.nbytes if _append_only(c) else 0


def _defer_layer(c: Any, length: int) -> LayerSnapshot | None:
    if isinstance(c, CacheList):
        children = tuple(_defer_layer(x, length) for x in c.caches)
        return LayerSnapshot(type(c), (), children)  # type: ignore[arg-type]
    if _append_only(c):
        _check_offset(c, length)
        return None
    return _capture_layer(c, length)


def _complete_layer(x: LayerSnapshot | None, c: Any, length: int) -> LayerSnapshot:
    if x is None:
        assert _append_only(c) and c.offset >= length, "deferred KV layer rewound"
        return LayerSnapshot(type(c), _kv_state(c, length))
    if x.children:
        children = zip(x.children, c.caches, strict=True)
        return LayerSnapshot(x.cls, (), tuple(_complete_layer(y, z, length) for y, z in children))
    return x


def _kv_state(c: Any, n: int) -> tuple[Any, ...]:
    """The state of KV-like layer `c` keeping its first `n` tokens, as fresh views."""
    if isinstance(c, QuantizedKVCache):
        keys = tuple(_head(x, n) for x in c.keys)
        values = tuple(_head(x, n) for x in c.values)
        return (keys, values, n, c.group_size, c.bits)
    if isinstance(c, ChunkedKVCache):
        m = n - c.start_position
        return (_head(c.keys, m), _head(c.values, m), n, c.chunk_size, c.start_position)
    if isinstance(c, RotatingKVCache):
        if c.offset >= c.max_size:  # wrapped: a ring, keep it whole
            assert n == c.offset, "a wrapped RotatingKVCache cannot be trimmed"
            return (_view(c.keys), _view(c.values), c.offset, c.keep, c.max_size, c._idx)
        assert c._idx == c.offset, "unwrapped RotatingKVCache out of temporal order"
        return (_head(c.keys, n), _head(c.values, n), n, c.keep, c.max_size, n)
    if isinstance(c, ConcatenateKVCache):
        return (_head(c.keys, n), _head(c.values, n))
    return (_head(c.keys, n), _head(c.values, n), n)


def _restore_layer(layer: LayerSnapshot, trim: int) -> Any:
    cls = layer.cls
    if issubclass(cls, CacheList):
        return cls(*(_restore_layer(x, trim) for x in layer.children))
    if issubclass(cls, _KV_CLASSES):
        if layer.state[0] is None:
            return cls.from_state(tuple(layer.state))
        src = cls.from_state(layer.state)  # read only: its arrays are the snapshot's
        keep = src.offset - trim
        if isinstance(src, ChunkedKVCache) and keep < src.start_position:
            raise ValueError("trim reaches past a ChunkedKVCache's retained window")
        return cls.from_state(_kv_state(src, keep))
    if issubclass(cls, ArraysCache):
        arrays, left_padding, lengths = layer.state
        assert trim == 0
        # A list: models assign `cache[i] = ...`.
        return cls.from_state(([_view(a) for a in arrays], _view(left_padding), _view(lengths)))
    obj = cls.from_state(tree_map(_view, layer.state))
    if trim:
        obj.trim(trim)
    return obj


def _arrays(layers: tuple[LayerSnapshot | None, ...]) -> list[mx.array]:
    out: list[mx.array] = []
    for layer in layers:
        if layer is None:
            continue
        out.extend(a for _, a in tree_flatten(list(layer.state)) if isinstance(a, mx.array))
        out.extend(_arrays(layer.children))
    return out


def _cache_arrays(c: Any) -> list[mx.array]:
    if isinstance(c, CacheList):
        return [a for x in c.caches for a in _cache_arrays(x)]
    return [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
