"""Quantized attention KV (mlx-lm's QuantizedKVCache, --kv-bits): append-only, restored
only exactly (positions below --quantized-kv-start are float in a cold run:
engine/forward/kv_quant.py), never batched (mlx-lm has no batched quantized cache)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import QuantizedKVCache

from mlx_prefix.cache.layers.base import head
from mlx_prefix.cache.layers.kv import KvKind


class QuantizedKvKind(KvKind):
    """Positions kept: each of (packed, scales, biases)[..., :n, :]."""

    classes = (QuantizedKVCache,)
    always_trimmable = False
    exact_only = True
    quantized = True

    def keeping(self, c: Any, n: int) -> tuple[Any, ...]:
        keys = tuple(head(x, n) for x in c.keys)
        values = tuple(head(x, n) for x in c.values)
        return (keys, values, n, c.group_size, c.bits)

    def split(self, state: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        keys, values, _, group_size, bits = state
        return (*keys, *values), (group_size, bits)

    def join(self, arrays: tuple[Any, ...], n: int, rest: tuple[Any, ...]) -> tuple:
        half = len(arrays) // 2
        return (tuple(arrays[:half]), tuple(arrays[half:]), n, *rest)

    def batchable(self, c: Any) -> bool:
        return False

    def quantizes(self, c: Any, start: int) -> bool:
        return False  # already quantized
