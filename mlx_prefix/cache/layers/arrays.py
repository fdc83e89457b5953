"""Recurrent / SSM state (mlx-lm's ArraysCache: Mamba, Qwen3.5's and Nemotron-H's
linear layers, LFM2's convolutions): replaced as a whole each step, never trimmed, so
it restores only from an exact checkpoint."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mlx_prefix.cache.layers.base import EQUAL_TAILS, LayerKind, LayerSnapshot, view


class ArraysKind(LayerKind):
    """Every state array kept as is."""

    classes = (ArraysCache,)
    cost_role = "recurrent"

    def capture(self, c: Any, length: int) -> LayerSnapshot:
        arrays, left_padding, lengths = c.state
        # Copied down to their own size when they are views of a larger buffer.
        own = tuple(mx.contiguous(a) if isinstance(a, mx.array) else a for a in arrays)
        return LayerSnapshot(type(c), (own, view(left_padding), view(lengths)))

    def restore(self, layer: LayerSnapshot, trim: int) -> Any:
        arrays, left_padding, lengths = layer.state
        assert trim == 0, "recurrent state cannot be trimmed"
        # A list: models assign `cache[i] = ...`.
        return layer.cls.from_state(([view(a) for a in arrays], view(left_padding), view(lengths)))

    def tail_stacking(self, c: Any) -> int:
        # Each row's state goes on from its own history. Right padding would run the
        # recurrence over the pads unless the model honours mlx-lm's `lengths`, which
        # not every model does: equal tails only.
        return EQUAL_TAILS
