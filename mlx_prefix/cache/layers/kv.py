"""Attention KV (mlx-lm's KVCache, ConcatenateKVCache): append-only, trimmable to any
earlier position, quantizable by --kv-bits, merged into BatchKVCache for decode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, ConcatenateKVCache, KVCache

from mlx_prefix.cache.layers.base import (
    NO_STACKING,
    PADDED_TAILS,
    LayerKind,
    LayerSnapshot,
    check_offset,
    head,
)


class KvKind(LayerKind):
    """Positions kept: keys[..., :n, :], offset = n (a KVCache's buffer is step-padded
    past its offset; a restored one holds exactly n, so its first write reallocates
    rather than writing into memory a snapshot still references)."""

    classes: tuple[type, ...] = (KVCache,)
    append_only = True
    always_trimmable = True

    def capture(self, c: Any, length: int) -> LayerSnapshot:
        check_offset(c, length)
        if c.keys is None:
            return LayerSnapshot(type(c), tuple(c.state))
        return LayerSnapshot(type(c), self.keeping(c, c.offset))

    def keeping(self, c: Any, n: int) -> tuple[Any, ...]:
        """The state of `c` keeping its first `n` tokens, as fresh views."""
        return (head(c.keys, n), head(c.values, n), n)

    def restore(self, layer: LayerSnapshot, trim: int) -> Any:
        if layer.state[0] is None:
            return layer.cls.from_state(tuple(layer.state))
        src = layer.cls.from_state(layer.state)  # read only: its arrays are the snapshot's
        return layer.cls.from_state(self.keeping(src, src.offset - trim))

    def merge(self, layers: Sequence[Any], steps: int) -> Any:
        if steps and all(type(c) is KVCache and c.keys is not None for c in layers):
            return _merged_with_room(layers, steps)
        return super().merge(layers, steps)

    def quantizes(self, c: Any, start: int) -> bool:
        # Exactly KVCache, as mlx_lm's maybe_quantize_kv_cache converts.
        return type(c) is KVCache and c.offset >= start

    def tail_stacking(self, c: Any) -> int:
        # BatchKVCache masks right padding in the forward and moves it to the left after.
        return PADDED_TAILS if type(c) is KVCache else NO_STACKING


class ConcatenateKvKind(KvKind):
    classes = (ConcatenateKVCache,)

    def keeping(self, c: Any, n: int) -> tuple[Any, ...]:
        return (head(c.keys, n), head(c.values, n))

    def quantizes(self, c: Any, start: int) -> bool:
        return False


def _merged_with_room(layers: Sequence[Any], steps: int) -> BatchKVCache:
    """mlx_lm's BatchKVCache.merge into a buffer with room for the next `steps` tokens
    (at most up to the next multiple of its growth step): its own holds exactly the
    longest sequence, so the first decode step would copy the whole batch again to grow
    it. The keys a step returns (the buffer up to `_idx`) are the same. The room is
    resident memory, counted as such (invariant 6): no more than the sequences may use."""
    longest = max(c.offset for c in layers)
    size = min(longest + steps, (longest // BatchKVCache.step + 1) * BatchKVCache.step)
    first = layers[0]
    _, heads, _, k_dim = first.keys.shape
    keys = mx.zeros((len(layers), heads, size, k_dim), first.keys.dtype)
    values = mx.zeros((len(layers), heads, size, first.values.shape[3]), first.values.dtype)
    padding = [longest - c.offset for c in layers]
    for i, (pad, c) in enumerate(zip(padding, layers, strict=True)):
        keys[i : i + 1, :, pad:longest] = c.keys[..., : c.offset, :]
        values[i : i + 1, :, pad:longest] = c.values[..., : c.offset, :]
    cache: Any = BatchKVCache(padding)
    cache.keys, cache.values = keys, values
    cache.offset += longest
    cache._idx = longest
    return cache
