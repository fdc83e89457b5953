"""A cache held across a verify (cache/layers/rewind.py) is put back exactly as it was,
whatever the verify wrote: a ring written in place, an offset MLX updates in place, a
recurrent state replaced; append-only KV is trimmed back without holding its buffer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from mlx_prefix.cache.layers.rewind import hold, trims_back


def _kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    return mx.random.normal((1, 2, n, 4), key=key), mx.random.normal((1, 2, n, 4), key=key + 1)


def _copy(tree):
    return [np.array(a) if isinstance(a, mx.array) else a for a in tree]


def _equal(a, b) -> bool:
    return all(
        np.array_equal(np.array(x), y) if isinstance(y, np.ndarray) else x == y
        for x, y in zip(a, b, strict=True)
    )


def test_a_wrapped_ring_written_in_place_is_put_back():
    ring = RotatingKVCache(max_size=8)
    ring.update_and_fetch(*_kv(12, 0))  # the prompt wraps the window
    for i in range(3):
        ring.update_and_fetch(*_kv(1, 10 + i))  # single tokens: written into the ring
    mx.eval(ring.keys, ring.values)
    before = _copy([ring.keys, ring.values]) + [ring.offset, ring._idx]
    held = hold([ring])
    for i in range(4):  # a draft model's steps overwrite slots of the ring
        ring.update_and_fetch(*_kv(1, 20 + i))
    mx.eval(ring.keys, ring.values)
    assert not _equal([ring.keys, ring.values, ring.offset, ring._idx], before)
    held.restore()
    assert _equal([ring.keys, ring.values, ring.offset, ring._idx], before)
    assert not trims_back([ring])


def test_a_recurrent_state_and_a_cache_list_are_put_back():
    state = ArraysCache(size=2)
    state[0], state[1] = mx.ones((1, 3, 4)), mx.full((1, 2, 4, 4), 2.0)
    kv = KVCache()
    kv.update_and_fetch(*_kv(5, 1))
    layers = [state, CacheList(KVCache(), ArraysCache(size=1)), kv]
    inner = layers[1].caches[1]
    inner[0] = mx.zeros((1, 2))
    before = _copy([state[0], state[1], inner[0]])
    held = hold(layers)
    state[0], state[1], inner[0] = state[0] + 1, state[1] * 3, inner[0] - 1
    kv.update_and_fetch(*_kv(3, 2))
    assert kv.offset == 8
    held.restore()
    assert _equal([state[0], state[1], inner[0]], before)
    assert kv.offset == 5  # trimmed back: its buffer was not held
    assert not trims_back(layers) and trims_back([kv, CacheList(KVCache())])
