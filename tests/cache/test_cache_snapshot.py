from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, lfm2, llama
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    trim_prompt_cache,
)

from mlx_prefix.cache.chain import chained
from mlx_prefix.cache.layers import layers_of
from mlx_prefix.cache.snapshot import Snapshot, cache_nbytes, capture, is_trimmable, restore

H, D = 2, 32  # kv heads, head dim (32: QuantizedKVCache needs a multiple of its group)


def _kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))  # [B, H, L, D]
    v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 10_000))
    return k, v


def _step(c: Any, n: int, seed: int) -> list[mx.array]:
    """Advance one layer by `n` tokens (mutates `c`); returns what a model would read."""
    if isinstance(c, CacheList):
        return [a for i, x in enumerate(c.caches) for a in _step(x, n, seed + 97 * i)]
    if isinstance(c, ArraysCache):
        # A recurrent layer: rebinds one slot and writes into another in place.
        c[0] = mx.random.normal((1, 3, D), key=mx.random.key(seed))
        if c[1] is None:
            c[1] = mx.zeros((1, H, D))
        c[1][..., :1, :] = mx.full((1, 1, D), float(seed))
        return [a for a in c.cache if a is not None]
    k, v = _kv(n, seed)
    return [a for _, a in tree_flatten(list(c.update_and_fetch(k, v)))]


def _advance(cache: list[Any], chunks: list[int], seed: int) -> list[mx.array]:
    out = []
    for i, n in enumerate(chunks):
        for j, c in enumerate(cache):
            out.extend(_step(c, n, seed + 1000 * i + 17 * j))
    mx.eval(out)
    return out


def _snapshot_arrays(s: Snapshot) -> list[np.ndarray]:
    """Every array a snapshot holds: its layers' state and its chain's pieces."""

    def walk(layers) -> list[np.ndarray]:
        out = []
        for layer in layers:
            leaves = tree_flatten(list(layer.state))
            out += [np.array(a) for _, a in leaves if isinstance(a, mx.array)]
            out += walk(layer.children)
        return out

    return walk(s.layers) + [np.array(a) for a in s.chain.arrays()]


def _same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    return all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a, b, strict=True))


# name -> (factory for one model's cache list, prefill chunks, trimmable after prefill)
CASES: dict[str, tuple[Callable[[], list[Any]], list[int], bool]] = {
    "kv": (lambda: [KVCache(), KVCache()], [7, 13, 1], True),
    "kv_step_aligned": (lambda: [KVCache()], [256], True),
    "concatenate": (lambda: [ConcatenateKVCache()], [5, 6], True),
    # Quantized KV restores only exactly (engine/forward/kv_quant.py: below --quantized-kv-start a
    # cold run holds float KV), so it does not count as trimmable.
    "quantized": (lambda: [QuantizedKVCache(group_size=32, bits=8)], [9, 1, 1], False),
    "chunked": (lambda: [ChunkedKVCache(chunk_size=64)], [10, 11], True),
    "rotating_unwrapped": (lambda: [RotatingKVCache(max_size=32, keep=2)], [10, 1, 1, 5], True),
    "rotating_in_place": (lambda: [RotatingKVCache(max_size=32)], [1] * 12, True),
    "rotating_wrapped_concat": (lambda: [RotatingKVCache(max_size=16, keep=2)], [12, 9], False),
    "rotating_wrapped_ring": (
        lambda: [RotatingKVCache(max_size=16, keep=2)],
        [10] + [1] * 9,
        False,
    ),
    "arrays": (lambda: [ArraysCache(size=2), ArraysCache(size=2)], [4, 4], False),
    "cachelist_kv": (lambda: [CacheList(KVCache(), KVCache())], [6, 3], True),
    "cachelist_hybrid": (lambda: [CacheList(KVCache(), ArraysCache(size=2))], [6, 3], False),
    "mixed": (lambda: [KVCache(), ArraysCache(size=2), RotatingKVCache(max_size=64)], [8], False),
}


def _build(name: str) -> tuple[list[Any], int, bool]:
    factory, chunks, trimmable = CASES[name]
    cache = factory()
    _advance(cache, chunks, seed=1)
    return cache, sum(chunks), trimmable


@pytest.mark.parametrize("name", sorted(CASES))
def test_restored_cache_cannot_change_the_snapshot(name: str):
    orig, length, trimmable = _build(name)
    twin = copy.deepcopy(orig)  # the reference continuation
    snap = capture(orig, length)
    assert snap.length == length and snap.trimmable is trimmable == is_trimmable(orig)
    before = _snapshot_arrays(snap)
    # It counts at least its own arrays, and every buffer their views keep alive; its
    # KV pieces exactly as long as the prefix (no step padding).
    assert before and snap.nbytes >= sum(a.nbytes for a in before)
    assert snap.nbytes >= cache_nbytes([c for c in layers_of(orig) if not chained(c)])
    for piece in snap.chain.pieces:
        assert all(a.shape[-2] == piece.end - piece.start for p in piece.parts for a in p)

    restored = restore(snap)
    assert all(type(r) is type(o) for r, o in zip(restored, orig, strict=True))
    # The restored cache continues exactly like the original would...
    assert _same(_advance(restored, [1, 3, 1], 50), _advance(twin, [1, 3, 1], 50))
    # ...and neither its writes nor the source's own later writes reach the snapshot.
    _advance(restored, [40, 1], 60)
    _advance(orig, [1, 2, 30], 70)
    assert _same(_snapshot_arrays(snap), before)

    again = restore(snap)
    twin2 = _build(name)[0]
    assert _same(_advance(again, [2, 1], 80), _advance(twin2, [2, 1], 80))


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2]))
@pytest.mark.parametrize("trim", [1, 5])
def test_trim_on_restore(name: str, trim: int):
    orig, length, _ = _build(name)
    snap = capture(orig, length)
    before = _snapshot_arrays(snap)
    twin = copy.deepcopy(orig)
    assert trim_prompt_cache(twin, trim) == trim
    restored = restore(snap, trim=trim)
    for c in restored:
        for x in c.caches if isinstance(c, CacheList) else [c]:
            assert x.offset == length - trim
    if name == "concatenate":
        # mlx-lm's ConcatenateKVCache.trim leaves the tail in `keys` (its next
        # update appends after it); a restore slices it off instead.
        keys = restored[0].update_and_fetch(*_kv(4, 90))[0]
        expect = mx.concatenate([orig[0].keys[..., : length - trim, :], _kv(4, 90)[0]], axis=2)
        assert np.array_equal(np.array(keys), np.array(expect))
    else:
        assert _same(_advance(restored, [4, 1], 90), _advance(twin, [4, 1], 90))
    assert _same(_snapshot_arrays(snap), before)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if not c[2]))
def test_non_trimmable_refuses_trim(name: str):
    orig, length, _ = _build(name)
    snap = capture(orig, length)
    with pytest.raises(ValueError):
        restore(snap, trim=1)


def test_capture_checks_the_offset():
    cache = [KVCache()]
    _advance(cache, [5], 1)
    with pytest.raises(ValueError):
        capture(cache, 6)
    with pytest.raises(ValueError):
        restore(capture(cache, 5), trim=6)


def test_kv_snapshot_is_exactly_offset_long_and_restore_reallocates():
    cache = [KVCache()]
    _advance(cache, [10], 1)
    assert cache[0].keys.shape[2] == 256  # step-padded buffer
    snap = capture(cache, 10)
    # A piece of its own, 10 tokens long: it keeps no step padding (nor the live buffer)
    # alive, and the byte budget counts exactly that.
    (piece,) = snap.chain.pieces
    assert all(a.shape[2] == 10 for a in piece.parts[0])
    assert snap.nbytes == piece.buffer.nbytes == 2 * 10 * H * D * 4
    r = restore(snap)[0]
    assert r.keys.shape[2] == 10 and r.offset == 10
    keys_before = r.keys
    _step(r, 1, 5)
    assert r.keys is not keys_before and r.keys.shape[2] > 10  # a new buffer


def _data_ptr(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]


def test_restore_shares_buffers_without_copying():
    cache = [KVCache() for _ in range(4)]
    _advance(cache, [2048], 1)
    snap = capture(cache, 2048)
    mx.eval(cache)
    base = mx.get_active_memory()
    restored = restore(snap, trim=100)
    # One piece and no room asked: views, not copies: no new memory, same data pointers
    # as the snapshot's piece.
    assert mx.get_active_memory() - base < snap.nbytes // 100
    (piece,) = snap.chain.pieces
    for r, part in zip(restored, piece.parts, strict=True):
        assert _data_ptr(r.keys) == _data_ptr(part[0])
        assert r.keys is not part[0]
    assert cache_nbytes(restored) == snap.nbytes * (2048 - 100) // 2048


def _llama() -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=97,
    )
    return llama.Model(args)


def _lfm2() -> lfm2.Model:
    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=32,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        intermediate_size=64,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    )
    return lfm2.Model(args)


def _gemma3() -> gemma3_text.Model:
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=97,
        num_key_value_heads=1,
        sliding_window=8,
        sliding_window_pattern=2,
    )
    return gemma3_text.Model(args)


@pytest.mark.parametrize("make_model", [_llama, _lfm2, _gemma3], ids=["llama", "lfm2", "gemma3"])
def test_model_forward_from_restored_cache(make_model):
    mx.random.seed(3)
    model = make_model()
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, 97, (1, 40))
    prefix, rest = tokens[:, :24], tokens[:, 24:]

    cache = model.make_cache()
    model(prefix[:, :16], cache=cache)
    model(prefix[:, 16:], cache=cache)
    mx.eval([c.state for c in cache])
    snap = capture(cache, 24)
    before = _snapshot_arrays(snap)
    cold = model(rest, cache=cache)  # the source keeps going
    for t in range(3):  # and decodes
        model(tokens[:, t : t + 1], cache=cache)
    mx.eval(cold)

    for _ in range(2):
        restored = restore(snap)
        warm = model(rest, cache=restored)
        for t in range(3):
            model(tokens[:, t : t + 1], cache=restored)
        assert np.array_equal(np.array(warm), np.array(cold))
        assert _same(_snapshot_arrays(snap), before)

    if snap.trimmable:
        trimmed = restore(snap, trim=8)  # back to 16 tokens
        ref = model.make_cache()
        model(prefix[:, :16], cache=ref)
        expect = model(tokens[:, 16:], cache=ref)
        got = model(tokens[:, 16:], cache=trimmed)
        assert np.allclose(np.array(got), np.array(expect), atol=1e-5)
        assert _same(_snapshot_arrays(snap), before)
