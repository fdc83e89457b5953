"""Sliding-window attention (mlx-lm's RotatingKVCache): trimmable until its ring wraps,
then restored only exactly; decoded in a batch whose rows stay in temporal order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from mlx_prefix.cache.layers.base import head, view
from mlx_prefix.cache.layers.kv import KvKind


class RotatingKvKind(KvKind):
    """Positions kept: unwrapped, keys[..., :n, :] with _idx = n (temporal order while
    offset < max_size); wrapped, the whole ring buffer as is (not trimmable)."""

    classes = (RotatingKVCache,)
    append_only = False  # its ring is written in place
    chained = False
    always_trimmable = False
    cost_role = "window"

    def keeping(self, c: Any, n: int) -> tuple[Any, ...]:
        if c.offset >= c.max_size:  # wrapped: a ring, keep it whole
            assert n == c.offset, "a wrapped RotatingKVCache cannot be trimmed"
            return (view(c.keys), view(c.values), c.offset, c.keep, c.max_size, c._idx)
        assert c._idx == c.offset, "unwrapped RotatingKVCache out of temporal order"
        return (head(c.keys, n), head(c.values, n), n, c.keep, c.max_size, n)

    def merge(self, layers: Sequence[Any], steps: int) -> Any:
        return TemporalBatchRotatingKVCache.merge(list(layers))

    def quantizes(self, c: Any, start: int) -> bool:
        return False  # mlx_lm cannot quantize a rotating cache


class TemporalBatchRotatingKVCache(BatchRotatingKVCache):
    """A batch of sliding-window caches whose rows stay in temporal order at every
    decode step, whatever the other rows do.

    mlx-lm's BatchRotatingKVCache writes each token in place at one ring index shared
    by all rows, and re-linearizes rows when another joins, so a row's keys sit in an
    order that depends on its neighbours, and attention sums them in that order
    (measured: differences from the first step for a row shorter than the window,
    ~1e-6). Here every row's window is kept in temporal order (oldest key dropped,
    newest appended, shorter rows left-padded and masked), which is what a row
    decoding alone holds."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # The concat path keeps temporal order: for one new token it drops the oldest
        # key once the window is full, so the buffer is exactly the attended window.
        return self._update_concat(keys, values)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N > 1:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        # [B, 1, 1, T]: after this step's write the buffer holds T keys, all inside the
        # window; only each row's left padding is masked.
        held = self._idx if self.keys is not None else 0
        trim = max(0, held + 1 - self.max_size)
        length = held + 1 - trim
        left_padding = self.left_padding - trim
        return mx.arange(length)[None] >= mx.expand_dims(left_padding, (1, 2, 3))
