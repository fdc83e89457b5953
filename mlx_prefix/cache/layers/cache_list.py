"""Several caches in one layer (mlx-lm's CacheList, e.g. a layer with attention and a
recurrent part): every member handled by its own kind."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import CacheList, RotatingKVCache

from mlx_prefix.cache.layers.base import LayerKind, LayerSnapshot


class CacheListKind(LayerKind):
    classes = (CacheList,)

    def capture(self, c: Any, length: int) -> LayerSnapshot:
        from mlx_prefix.cache.layers import kind_of

        members = tuple(kind_of(x).capture(x, length) for x in c.caches)
        return LayerSnapshot(type(c), (), members)

    def restore(self, layer: LayerSnapshot, trim: int) -> Any:
        from mlx_prefix.cache.layers import kind_of

        return layer.cls(*(kind_of(x.cls).restore(x, trim) for x in layer.children))

    def batchable(self, c: Any) -> bool:
        from mlx_prefix.cache.layers import kind_of

        # A rotating member would merge through mlx-lm's own ring (not temporal order).
        return all(kind_of(x).batchable(x) and not isinstance(x, RotatingKVCache) for x in c.caches)

    def merge(self, layers: Sequence[Any], steps: int) -> Any:
        return type(layers[0]).merge(list(layers))

    def tail_stacking(self, c: Any) -> int:
        from mlx_prefix.cache.layers import kind_of

        return min(kind_of(x).tail_stacking(x) for x in c.caches)

    def arrays(self, c: Any) -> list[Any]:
        from mlx_prefix.cache.layers import kind_of

        return [a for x in c.caches for a in kind_of(x).arrays(x)]
