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
    stashed,
    view,
)


class KvKind(LayerKind):
    """Positions kept: keys[..., :n, :], offset = n (a KVCache's buffer is step-padded
    past its offset; a restored one holds exactly n, so its first write reallocates
    rather than writing into memory a snapshot still references)."""

    classes: tuple[type, ...] = (KVCache,)
    append_only = True
    always_trimmable = True
    chained = True

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

    # -- as a chain of pieces (cache/chain.py) -------------------------------------------
    def split(self, state: tuple[Any, ...]) -> tuple[tuple[mx.array, ...], tuple[Any, ...]]:
        return (state[0], state[1]), ()

    def join(self, arrays: tuple[mx.array, ...], n: int, rest: tuple[Any, ...]) -> tuple:
        return (arrays[0], arrays[1], n)

    def holds(self, state: tuple[Any, ...], n: int) -> bool:
        """Whether `state` (read from a file) is this kind's whole state of `n` positions,
        which `split` takes apart."""
        try:
            arrays, rest = self.split(state)
        except (TypeError, ValueError, IndexError):
            return False
        if not arrays or not all(
            isinstance(a, mx.array) and a.ndim == 4 and a.shape[-2] >= n for a in arrays
        ):
            return False
        joined = self.join(arrays, n, rest)
        return len(joined) == len(state) and all(
            x == y for x, y in zip(joined[2:], state[2:], strict=True)
        )

    def cut(self, c: Any, start: int, end: int) -> tuple[mx.array, ...]:
        """Live layer `c`'s positions [start, end), copied into arrays of their own
        (lazy). Does not mutate `c`."""
        arrays, _ = self.split(c.state)
        return tuple(mx.contiguous(a[..., start:end, :]) for a in arrays)

    def room(self, cls: type, length: int, extend: int) -> int:
        """Positions a restored layer of `length` positions leaves past its offset so
        that a first append of `extend` tokens writes in place: up to the next whole
        step past them, the buffer a cold prefill's growth holds there. Not the prefix
        plus whole steps (mlx-lm's growth from an offset off the step grid): a resent
        prompt restored a few tokens before its end would hold most of a step more KV
        than its cold run, more than a budget of 1.25x the conversation leaves
        (issue 55)."""
        step = getattr(cls, "step", 0)
        return -(-(length + extend) // step) * step - length if extend and step else 0

    def merge(self, layers: Sequence[Any], steps: int) -> Any:
        if len(layers) == 1 and _adoptable(layers[0]):
            return _adopted(layers[0])
        if (
            all(type(c) is KVCache for c in layers)
            and any(c.keys is not None for c in layers)
            and (steps or any(stashed(c) is not None for c in layers))
        ):
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

    def join(self, arrays: tuple[mx.array, ...], n: int, rest: tuple[Any, ...]) -> tuple:
        return (head(arrays[0], n), head(arrays[1], n))  # its offset is the keys' length

    def room(self, cls: type, length: int, extend: int) -> int:
        return 0  # it concatenates on every append

    def quantizes(self, c: Any, start: int) -> bool:
        return False


def _adoptable(c: Any) -> bool:
    return type(c) is KVCache and c.keys is not None and stashed(c) is None


def _adopted(c: Any) -> BatchKVCache:
    """A lone request's prefill cache as a batch of one, over the same buffer (no copy):
    a copy would hold the conversation's KV twice while the prefill's buffer is freed,
    which a budget of little more than one conversation cannot hold (issue 55). Fresh
    array objects (views): the prefill's layer must not see the batch's writes; once it
    is gone the batch's appends write in place, as into its own buffer. The keys a step
    reads (the buffer up to `_idx`) are the same as a merged copy's."""
    cache: Any = BatchKVCache([0])
    cache.keys, cache.values = view(c.keys), view(c.values)
    cache.offset += c.offset
    cache._idx = c.offset
    return cache


def _merged_with_room(layers: Sequence[Any], steps: int) -> BatchKVCache:
    """mlx_lm's BatchKVCache.merge into a buffer with room for the next `steps` tokens
    (at most up to the next multiple of its growth step): its own holds exactly the
    longest sequence, so the first decode step would copy the whole batch again to grow
    it. The keys a step returns (the buffer up to `_idx`) are the same. The room is
    resident memory, counted as such (invariant 6): no more than the sequences may use.
    A restored layer not written since is copied from its chain's parts (base.py
    `stashed`), not from the concatenation it would evaluate first: one copy."""
    longest = max(c.offset for c in layers)
    size = min(longest + steps, (longest // BatchKVCache.step + 1) * BatchKVCache.step)
    first = next(c for c in layers if c.keys is not None)
    _, heads, _, k_dim = first.keys.shape
    keys = mx.zeros((len(layers), heads, size, k_dim), first.keys.dtype)
    values = mx.zeros((len(layers), heads, size, first.values.shape[3]), first.values.dtype)
    padding = [longest - c.offset for c in layers]
    for i, (pad, c) in enumerate(zip(padding, layers, strict=True)):
        if c.keys is None:
            continue  # nothing yet: all padding
        parts = stashed(c) or [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]
        at = pad
        for k, v in parts:
            n = k.shape[-2]
            keys[i : i + 1, :, at : at + n] = k
            values[i : i + 1, :, at : at + n] = v
            at += n
        assert at == longest, "parts must cover the restored offset"
    cache: Any = BatchKVCache(padding)
    cache.keys, cache.values = keys, values
    cache.offset += longest
    cache._idx = longest
    return cache
