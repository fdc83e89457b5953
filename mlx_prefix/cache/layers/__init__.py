"""One adapter per mlx-lm cache class (a `LayerKind`, base.py): how a layer of that
class is captured and restored, trimmed, batched for decode, quantized and costed.
The engine asks `kind_of(layer)` instead of testing classes, so a model family with a
new cache class is one module here, added to KINDS.

    kv.py          KVCache, ConcatenateKVCache: append-only attention KV
    quantized.py   QuantizedKVCache (--kv-bits): restored only exactly, decoded alone
    chunked.py     ChunkedKVCache: attention KV from a start position on
    rotating.py    RotatingKVCache (sliding window), TemporalBatchRotatingKVCache
    arrays.py      ArraysCache: recurrent / SSM state, restored only exactly
    cache_list.py  CacheList: a layer of several caches, each by its own kind
"""

from __future__ import annotations

from typing import Any

from mlx_prefix.cache.layers.arrays import ArraysKind
from mlx_prefix.cache.layers.base import (
    EQUAL_TAILS,
    NO_STACKING,
    PADDED_TAILS,
    CostRole,
    LayerKind,
    LayerSnapshot,
)
from mlx_prefix.cache.layers.cache_list import CacheListKind
from mlx_prefix.cache.layers.chunked import ChunkedKvKind
from mlx_prefix.cache.layers.kv import ConcatenateKvKind, KvKind
from mlx_prefix.cache.layers.quantized import QuantizedKvKind
from mlx_prefix.cache.layers.rotating import RotatingKvKind, TemporalBatchRotatingKVCache

KINDS: tuple[LayerKind, ...] = (
    KvKind(),
    ConcatenateKvKind(),
    QuantizedKvKind(),
    ChunkedKvKind(),
    RotatingKvKind(),
    ArraysKind(),
    CacheListKind(),
)
_GENERIC = LayerKind()  # a class no kind names: whole-state captures, mlx-lm's merge
_BY_CLASS: dict[type, LayerKind] = {}


def kind_of(layer: Any) -> LayerKind:
    """The kind of a cache layer (or of a cache class): its class's own, else the kind
    of the nearest class it derives from, else the generic kind."""
    cls = layer if isinstance(layer, type) else type(layer)
    if cls not in _BY_CLASS:
        own = [k for k in KINDS if cls in k.classes]
        derived = [k for base in cls.__mro__ for k in KINDS if base in k.classes]
        _BY_CLASS[cls] = (own or derived or [_GENERIC])[0]
    return _BY_CLASS[cls]


def layers_of(cache: list[Any]) -> list[Any]:
    """Every cache object of a model's cache list, CacheList members in its place."""
    out: list[Any] = []
    for c in cache:
        out.extend(layers_of(list(c.caches)) if isinstance(kind_of(c), CacheListKind) else [c])
    return out


__all__ = [
    "EQUAL_TAILS",
    "KINDS",
    "NO_STACKING",
    "PADDED_TAILS",
    "CacheListKind",
    "CostRole",
    "LayerKind",
    "LayerSnapshot",
    "TemporalBatchRotatingKVCache",
    "kind_of",
    "layers_of",
]
