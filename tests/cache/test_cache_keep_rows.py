"""A verify's rows settled to what each kept (cache/layers/rewind.py `keep_rows`): every
row's keys are its own tokens' in order, ending together, and where a row that kept a
long draft has the left padding for it, it alone moves, not the rows beside it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from mlx_prefix.cache.layers.rewind import keep_rows


def _cache(prompts: list[int], width: int) -> tuple[BatchKVCache, list[list[float]]]:
    """Rows of `prompts[i]` tokens, left-padded, then a verify of `width` positions a
    row; a position's key is its token's number (row * 1000 + position), padding -1."""
    longest = max(prompts)
    cache = BatchKVCache([longest - n for n in prompts])
    rows = [
        [-1.0] * (longest - n) + [r * 1000.0 + i for i in range(n)] for r, n in enumerate(prompts)
    ]
    keys = mx.array(rows)[:, None, :, None]
    cache.update_and_fetch(keys, keys)
    verify = mx.array([[r * 1000.0 + n + i for i in range(width)] for r, n in enumerate(prompts)])
    cache.update_and_fetch(verify[:, None, :, None], verify[:, None, :, None])
    return cache, rows


def _rows(cache: BatchKVCache) -> list[list[float]]:
    """Each row's keys after its left padding."""
    keys, _ = cache.keys_and_values()
    pads = cache.left_padding.tolist()
    return [keys[r, 0, pad:, 0].tolist() for r, pad in enumerate(pads)]


@pytest.mark.parametrize(
    ("prompts", "kept", "moved"),
    [
        ([20, 30, 12], [9, 1, 1], 1),  # row 0 has 10 of left padding: it moves left 8
        ([30, 20, 12], [9, 1, 1], 2),  # row 0 has none: the others move right
        ([20, 30, 12], [9, 3, 9], 1),  # row 1 moves right
        ([30, 30, 30], [4, 4, 4], 0),
    ],
)
def test_each_row_keeps_its_own_positions_and_the_fewest_rows_move(prompts, kept, moved):
    cache, _ = _cache(prompts, width=9)
    pads = cache.left_padding.tolist()
    keep_rows([cache], 9, kept)
    for r, (n, k) in enumerate(zip(prompts, kept, strict=True)):
        assert _rows(cache)[r] == [r * 1000.0 + i for i in range(n + k)]
    assert cache.offset.tolist() == [n + k for n, k in zip(prompts, kept, strict=True)]
    assert sum(a != b for a, b in zip(pads, cache.left_padding.tolist(), strict=True)) == moved
    # The next step writes every row's next position at the common end.
    step = mx.array(
        [[r * 1000.0 + n + k] for r, (n, k) in enumerate(zip(prompts, kept, strict=True))]
    )
    cache.update_and_fetch(step[:, None, :, None], step[:, None, :, None])
    for r, (n, k) in enumerate(zip(prompts, kept, strict=True)):
        assert _rows(cache)[r] == [r * 1000.0 + i for i in range(n + k + 1)]
