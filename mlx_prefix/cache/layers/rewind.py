"""A cache held across a speculative verify, to take back the positions of a rejected
draft where trimming cannot (engine/decode/batch.py `verify` / `settle`).

A recurrent layer (ArraysCache: conv and SSM state) keeps no per-position history, and
a sliding window that wrapped dropped the keys a shorter sequence still needs, so a
verify of k+1 positions through them cannot be trimmed back to the accepted prefix.
Instead each layer is held before the verify and, after a rejection, put back as it was;
the caller then computes the accepted positions again from there (what a decode step at
each of them computes: the state is plain decoding's, bit for bit).

Layers that trim a verify back exactly need no hold (`trims_back`): append-only attention
KV (KVCache, BatchKVCache), and the decode batch's sliding window
(TemporalBatchRotatingKVCache), which appends a verify's k+1 keys after the window's
last max_size-1 by concatenation, overwriting no slot, so trimming the rejected ones
leaves what the decode steps would have held. Otherwise, per kind of layer, the
cheapest hold that is exact:
- append-only attention KV: only its length; put back by trimming (positions below
  never change; holding its buffer would make the verify's in-place write copy it);
- anything else (ArraysCache's states, mlx-lm's RotatingKVCache, whose ring a draft
  model's steps overwrite in place, and their offsets): its
  attributes, each array as a view of its own, so that a write after the hold (the
  ring's in-place slice, `offset += 1`, which MLX does in place) leaves the held one as
  it was; a state replaced as a whole costs nothing more than the reference;
- CacheList: each member by its own kind.
Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, KVCache

from mlx_prefix.cache.layers.base import view
from mlx_prefix.cache.layers.rotating import TemporalBatchRotatingKVCache

# Puts a layer back; `keep`: the rows still in the batch (filtered since the hold).
Restore = Callable[[Sequence[int] | None], None]


def _length(c: Any) -> int:
    # BatchKVCache's offset is per row (an array); its write index is the buffer's length.
    return c._idx if isinstance(c, BatchKVCache) else c.offset


def _trim_back(c: Any) -> Restore:
    held = _length(c)

    def restore(keep: Sequence[int] | None) -> None:  # rows leave by `filter`: no row count
        extra = _length(c) - held
        if extra > 0:
            c.trim(extra)

    return restore


def _attributes(c: Any) -> Restore:
    held = {name: _copied(value) for name, value in vars(c).items()}

    def restore(keep: Sequence[int] | None) -> None:
        for name in [n for n in vars(c) if n not in held]:
            delattr(c, name)
        for name, value in held.items():
            setattr(c, name, _copied(value))  # the hold stays as it was
        if keep is not None:
            c.filter(mx.array(list(keep)))  # the hold's rows of requests that left meanwhile

    return restore


def _copied(value: Any) -> Any:
    if isinstance(value, list):  # ArraysCache's states: models assign `cache[i] = ...`
        return [view(v) for v in value]
    return view(value)


def _hold_layer(c: Any) -> list[Restore]:
    if isinstance(c, CacheList):
        return [r for member in c.caches for r in _hold_layer(member)]
    if isinstance(c, (KVCache, BatchKVCache)):
        return [_trim_back(c)]
    return [_attributes(c)]


@dataclass(slots=True)
class Held:
    """A cache's layers as they were at `hold`."""

    _restores: list[Restore]

    def restore(self, keep: Sequence[int] | None = None) -> None:
        """Put every layer back as it was held (the hold may be restored again); `keep`:
        the held rows still in the batch, in order (None: all)."""
        for restore in self._restores:
            restore(keep)


def hold(cache: Sequence[Any]) -> Held:
    """Hold a (batch or single) cache before a verify writes into it."""
    return Held([r for c in cache for r in _hold_layer(c)])


def trims_back(cache: Sequence[Any]) -> bool:
    """Whether trimming takes every layer of `cache` back from a verify exactly (else
    `hold` it before)."""
    exact = (KVCache, BatchKVCache, TemporalBatchRotatingKVCache)
    return all(
        trims_back(c.caches) if isinstance(c, CacheList) else isinstance(c, exact) for c in cache
    )


def _layers(cache: Sequence[Any]) -> list[Any]:
    return [m for c in cache for m in (_layers(c.caches) if isinstance(c, CacheList) else [c])]


def rows_settle(cache: Sequence[Any]) -> bool:
    """Whether every layer of a batch cache can settle rows that kept different counts of
    a verify (`shift_rows`; a recurrent layer with a `hold`, engine/decode/verify_rows.py)."""
    return all(type(c) in _ROWS for c in _layers(cache))


_ROWS = (BatchKVCache, TemporalBatchRotatingKVCache, ArraysCache)


@dataclass(slots=True)
class HeldRows:
    """A batch cache's recurrent layers (ArraysCache) as they were at `hold_recurrent`:
    put back row by row. Its attention layers are trimmed back by the caller instead
    (`shift_rows`), since a row leaving the batch may shift them left (mlx-lm's `filter`
    drops common left padding)."""

    _layers: list[Any]
    _held: list[list[Any]]

    def restore(self, rows: Sequence[bool], keep: Sequence[int] | None = None) -> None:
        """Put back the rows marked True (the others keep what they hold now); `keep`:
        the held rows still in the batch, in order (None: all)."""
        pick = mx.array(list(rows))
        taken = None if keep is None else mx.array(list(keep))
        for c, held in zip(self._layers, self._held, strict=True):
            now = list(c.cache)
            for i, (h, a) in enumerate(zip(held, now, strict=True)):
                if h is None or a is None:
                    continue
                h = h if taken is None else h[taken]
                c.cache[i] = mx.where(pick.reshape((-1,) + (1,) * (a.ndim - 1)), h, a)


def hold_recurrent(cache: Sequence[Any]) -> HeldRows:
    """Hold a batch cache's recurrent layers before a verify of several rows."""
    layers = [c for c in _layers(cache) if isinstance(c, ArraysCache)]
    return HeldRows(layers, [[view(a) for a in c.cache] for c in layers])


@contextmanager
def row_lengths(cache: Sequence[Any], lengths: Sequence[int]) -> Iterator[None]:
    """A forward of rows padded at their end to the longest (built inside the block):
    each recurrent layer's state stops at its row's length (mlx-lm's ArraysCache
    `lengths`: the models mask the pads out of the scan and keep the convolution's
    window ending there). Rows of one length need no mask."""
    arrays: list[Any] = [c for c in _layers(cache) if isinstance(c, ArraysCache)]
    masked = arrays if len(set(lengths)) > 1 else []
    for c in masked:
        c.lengths = mx.array(list(lengths))
    try:
        yield
    finally:
        for c in masked:
            c.lengths = None  # the layers counted it down (`advance`)


def shift_rows(cache: Sequence[Any], trim: int, shifts: Sequence[int]) -> None:
    """Drop every row's last `trim` positions, then move row i's keys right by
    `shifts[i]`, its left padding grown to match, so that rows which kept fewer stay
    left-padded (mlx-lm's right padding, `finalize`). Recurrent layers hold no
    positions: their rows were settled by `row_lengths` or put back (`hold`)."""
    for c in _layers(cache):
        if isinstance(c, ArraysCache):
            continue
        if trim:
            c.trim(trim)
        if not any(shifts):
            continue
        if isinstance(c, BatchRotatingKVCache):
            _pad_right(c, shifts)
            c.finalize()
        elif type(c) is BatchKVCache:
            _move(c, shifts)
        else:
            c.prepare(right_padding=list(shifts))
            c.finalize()


def keep_rows(cache: Sequence[Any], width: int, kept: Sequence[int]) -> None:
    """After a forward of `width` positions a row, row i keeps its first `kept[i]`: the
    rows end together at the end fewest of them move to (a row that kept more moves left
    into its left padding where it has the room, one that kept fewer moves right), the
    positions past it dropped. A row that moves copies its whole context (on a 2-core
    CPU at 2,000 tokens, 4 rows: about 90 ms for one row, 140 for three, against a
    300-360 ms step), so one row that kept a long draft moves, not the three beside it
    that drafted nothing. Other than plain BatchKVCache layers (sliding windows): every
    row to the most kept (`shift_rows`)."""
    layers = [c for c in _layers(cache) if not isinstance(c, ArraysCache)]
    most = max(kept)
    if not layers or any(type(c) is not BatchKVCache for c in layers):
        shift_rows(cache, width - most, [most - n for n in kept])
        return
    room = layers[0].left_padding.tolist()

    def moving(end: int) -> int:
        return sum(n != end for n in kept)

    ends = [e for e in set(kept) if all(r >= n - e for r, n in zip(room, kept, strict=True))]
    end = min(ends, key=lambda e: (moving(e), -e))  # `most` always has the room
    for c in layers:
        _move(c, [end - n for n in kept])
        c.trim(width - end)


def _move(c: Any, shifts: Sequence[int]) -> None:
    """Move row i's positions right by `shifts[i]` (left where negative, into its left
    padding), its left padding changed to match, writing only the rows that move: mlx-lm's
    `finalize` of right padding gathers every element of the whole buffer, every row, by
    index (on a 2-core CPU at 2,000 tokens of context, 4 rows, 30 layers: 620 ms, more
    than a decode step). Every row's source is sliced from the buffer as it was, before
    any write: a write whose source is a slice of the very buffer it writes cannot write
    it in place, so each such write copied the whole buffer; this way only the first
    does (3 rows moved: 270 ms before, 140 now). What a row moved right leaves behind is
    left padding, masked (c: a BatchKVCache holding keys)."""
    end = c._idx
    moves = [(row, max(s, 0), max(-s, 0)) for row, s in enumerate(shifts) if s]
    for a in (c.keys, c.values):  # each written in place: the cache's own array
        sources = [a[row : row + 1, :, left : end - right] for row, right, left in moves]
        for (row, right, left), source in zip(moves, sources, strict=True):
            a[row : row + 1, :, right : end - left] = source
    moved = mx.array(list(shifts))
    c.offset = c.offset - moved
    c.left_padding = c.left_padding + moved


def _pad_right(c: Any, shifts: Sequence[int]) -> None:
    # A sliding window's right padding is its `_lengths`; a buffer past `_idx` (trimmed)
    # goes first, or the roll would carry a row's last keys into it.
    c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
    c._lengths = c.offset - mx.array(list(shifts))
