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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache

from mlx_prefix.cache.layers.base import view
from mlx_prefix.cache.layers.rotating import TemporalBatchRotatingKVCache

Restore = Callable[[], None]


def _length(c: Any) -> int:
    # BatchKVCache's offset is per row (an array); its write index is the buffer's length.
    return c._idx if isinstance(c, BatchKVCache) else c.offset


def _trim_back(c: Any) -> Restore:
    held = _length(c)

    def restore() -> None:
        extra = _length(c) - held
        if extra > 0:
            c.trim(extra)

    return restore


def _attributes(c: Any) -> Restore:
    held = {name: _copied(value) for name, value in vars(c).items()}

    def restore() -> None:
        for name in [n for n in vars(c) if n not in held]:
            delattr(c, name)
        for name, value in held.items():
            setattr(c, name, _copied(value))  # the hold stays as it was

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

    def restore(self) -> None:
        """Put every layer back as it was held (the hold may be restored again)."""
        for restore in self._restores:
            restore()


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
