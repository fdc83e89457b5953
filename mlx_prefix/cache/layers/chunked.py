"""Chunked attention KV (mlx-lm's ChunkedKVCache, e.g. Llama 4): keeps the positions
from `start_position` on; trimmable back to that start, not past it."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ChunkedKVCache

from mlx_prefix.cache.layers.base import LayerSnapshot, head
from mlx_prefix.cache.layers.kv import KvKind


class ChunkedKvKind(KvKind):
    """Positions kept: keys[..., :n - start_position, :], offset = n."""

    classes = (ChunkedKVCache,)
    append_only = False  # it drops positions before `start_position`
    chained = False
    always_trimmable = False

    def keeping(self, c: Any, n: int) -> tuple[Any, ...]:
        m = n - c.start_position
        return (head(c.keys, m), head(c.values, m), n, c.chunk_size, c.start_position)

    def restore(self, layer: LayerSnapshot, trim: int) -> Any:
        if layer.state[0] is not None:
            src = layer.cls.from_state(layer.state)
            if src.offset - trim < src.start_position:
                raise ValueError("trim reaches past a ChunkedKVCache's retained window")
        return super().restore(layer, trim)

    def quantizes(self, c: Any, start: int) -> bool:
        return False
