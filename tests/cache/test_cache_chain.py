"""A snapshot's KV as a chain of pieces (cache/chain.py): a turn holds only what it adds,
a restore assembles the pieces with one copy and writes in place, pieces are never
written (invariant 2), and the store counts a shared piece once and never frees what an
entry or a running request still holds (invariant 6); with a real model, evicting the
middle of three chained entries frees only its own state, and the ends left restore to
what a cold prefill computes, bit for bit."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, QuantizedKVCache

from mlx_prefix.cache.layers import kind_of
from mlx_prefix.cache.layers.base import stashed
from mlx_prefix.cache.snapshot import Snapshot, capture, restore
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.cache.types import EvictOutcome

H, D = 2, 32  # kv heads, head dim
TOKEN = 2 * H * D * 4  # bytes of one token's K and V, one layer, float32


def _kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))  # [B, H, L, D]
    v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 10_000))
    return k, v


def _append(cache: list, n: int, seed: int) -> list[mx.array]:
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            c[0] = mx.random.normal((1, 3, D), key=mx.random.key(seed + i))
            out.append(c[0])
        else:
            out.extend(c.update_and_fetch(*_kv(n, seed + 31 * i)))
    mx.eval(out)
    return out


def _pieces(s: Snapshot) -> list[np.ndarray]:
    return [np.array(a) for a in s.chain.arrays()]


def _turns(make, lengths: list[int]) -> list[Snapshot]:
    """A conversation: each turn restored from the one before (with room for its first
    append, as the engine restores), extended, and captured continuing its chain."""
    cache = make()
    _append(cache, lengths[0], 1)
    snaps = [capture(cache, lengths[0])]
    for i, n in enumerate(lengths[1:], 1):
        prev = snaps[-1]
        cache = restore(prev, extend=n - prev.length)
        _append(cache, n - prev.length, 100 * i)
        snaps.append(capture(cache, n, prev.chain))
    return snaps


def test_a_turn_holds_only_what_it_adds_and_the_store_counts_each_token_once():
    a, b, c = _turns(lambda: [KVCache(), KVCache()], [10, 15, 40])
    assert [(p.start, p.end) for p in c.chain.pieces] == [(0, 10), (10, 15), (15, 40)]
    # Each piece is the parent's own buffer: the same keys, shared.
    assert b.chain.pieces[0].buffer == a.chain.pieces[0].buffer
    assert c.chain.pieces[:2] == b.chain.pieces
    assert [s.nbytes for s in (a, b, c)] == [2 * n * TOKEN for n in (10, 15, 40)]
    store = PromptCache(1 << 30)
    # Kinds that keep the shorter ones (trimming the longest would serve them).
    kinds = (CheckpointKind.SYSTEM, CheckpointKind.BREAKPOINT, CheckpointKind.LAST_MESSAGE)
    for s, kind in zip((a, b, c), kinds, strict=True):
        assert store.insert("m", list(range(s.length)), s, kind)
    assert store.stats().entries == 3
    # 40 distinct tokens, each once (not 10 + 15 + 40).
    assert store.stats().bytes == 2 * 40 * TOKEN
    store.check_integrity()


def test_a_chain_restores_what_the_whole_cache_would():
    snaps = _turns(lambda: [KVCache(), KVCache()], [10, 15, 40])
    twin = [KVCache(), KVCache()]  # the same tokens in one cache, never restored
    _append(twin, 10, 1)
    _append(twin, 5, 100)
    _append(twin, 25, 200)
    restored = restore(snaps[-1], extend=3)
    assert [c.offset for c in restored] == [40, 40]
    assert all(
        np.array_equal(np.array(x), np.array(y))
        for x, y in zip(_append(restored, 3, 7), _append(twin, 3, 7), strict=True)
    )
    # Trimmed back into the middle of a piece: the first 12 tokens.
    short = restore(snaps[-1], trim=28)
    expect = np.array(twin[0].keys[..., :12, :])
    assert short[0].offset == 12 and np.array_equal(np.array(short[0].keys[..., :12, :]), expect)


@pytest.mark.parametrize("extend", [0, 3, 300])
def test_nothing_a_restored_cache_writes_reaches_a_piece(extend):
    """Invariant 2 in the chained form: the restored buffer is a new one (or, for one
    piece and no room, a view whose first append reallocates), never a piece's."""
    for snaps in (_turns(lambda: [KVCache()], [10, 15]), _turns(lambda: [KVCache()], [10])):
        snap = snaps[-1]
        before = _pieces(snap)
        cache = restore(snap, extend=extend)
        _append(cache, max(extend, 1), 5)
        _append(cache, 1, 6)
        cache[0].trim(2)
        _append(cache, 4, 7)
        assert all(np.array_equal(x, y) for x, y in zip(_pieces(snap), before, strict=True))
        ptrs = {np.asarray(a).__array_interface__["data"][0] for a in snap.chain.arrays()}
        assert np.asarray(cache[0].keys).__array_interface__["data"][0] not in ptrs


def _peak_during(fn) -> int:
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    return mx.get_peak_memory() - base


def test_a_restore_and_first_append_copy_the_prefix_once_and_write_in_place():
    n, new = 4096, 100
    layers = 4
    chain_snaps = _turns(lambda: [KVCache() for _ in range(layers)], [1024, 2048, 3072, n])
    whole_snap = _turns(lambda: [KVCache() for _ in range(layers)], [n])[0]
    prefix = layers * n * TOKEN
    held: dict[str, list] = {}

    def first_append(snap: Snapshot, key: str, extend: int) -> None:
        held[key] = restore(snap, extend=extend)
        _append(held[key], new, 9)

    # Today's path (one whole piece, no room: the first append grows the buffer) and the
    # chain's (four pieces assembled with room) both peak at one new buffer of the
    # prefix plus the step: no second copy of the prefix.
    whole = _peak_during(lambda: first_append(whole_snap, "whole", 0))
    chained = _peak_during(lambda: first_append(chain_snaps[-1], "chain", new))
    # A second copy of the prefix would add all of it; what else is alive at the peak
    # (a layer's pieces not yet freed, the step's new K and V) moves with the machine's
    # scheduling (5% was passed by 40 KB once on a loaded box), so the margin is a quarter.
    assert chained <= whole + prefix // 4, (chained, whole)
    assert chained < 1.5 * prefix, (chained, prefix)
    # In place: the append wrote into the buffer the restore assembled (no growth).
    assert held["chain"][0].keys.shape[2] == n + KVCache.step


def test_a_merge_before_the_first_append_copies_the_parts_and_equals_mlx_lms():
    snaps = _turns(lambda: [KVCache()], [10, 15, 40])
    restored = restore(snaps[-1], extend=5)[0]
    other = restore(snaps[0], extend=5)[0]
    assert stashed(restored) is not None
    merged = kind_of(restored).merge([restored, other], 0)
    pieces = snaps[-1].chain.pieces
    ref_a = KVCache.from_state(
        (*(mx.concatenate([p.parts[0][i] for p in pieces], axis=-2) for i in (0, 1)), 40)
    )
    ref_b = KVCache.from_state((*snaps[0].chain.pieces[0].parts[0], 10))
    expect = BatchKVCache.merge([ref_a, ref_b])
    assert np.array_equal(np.array(merged.keys), np.array(expect.keys))
    assert np.array_equal(np.array(merged.values), np.array(expect.values))
    assert merged.keys.shape == expect.keys.shape and merged._idx == expect._idx
    # Once written, a restored layer's parts no longer describe it.
    _append([restored], 1, 3)
    assert stashed(restored) is None


def test_quantized_kv_chains_its_own_pieces_and_a_quantization_starts_the_chain_over():
    q = _turns(lambda: [QuantizedKVCache(group_size=32, bits=8)], [10, 20])
    assert [(p.start, p.end) for p in q[-1].chain.pieces] == [(0, 10), (10, 20)]
    assert q[-1].chain.forms == (QuantizedKVCache,)
    # A float chain continued by a cache quantized since: its KV is other bytes now.
    (floats,) = _turns(lambda: [KVCache()], [10])
    cache = restore(floats, extend=10)
    _append(cache, 10, 4)
    cache[0] = cache[0].to_quantized(group_size=32, bits=8)
    s = capture(cache, 20, floats.chain)
    assert [(p.start, p.end) for p in s.chain.pieces] == [(0, 20)]
    assert s.chain.forms == (QuantizedKVCache,)


def test_recurrent_state_stays_whole_and_only_the_kv_chains():
    a, b = _turns(lambda: [KVCache(), ArraysCache(size=1)], [10, 30])
    state = 3 * D * 4  # the recurrent layer's array
    assert a.nbytes == 10 * TOKEN + state and b.nbytes == 30 * TOKEN + state
    assert b.chain.pieces[0].buffer == a.chain.pieces[0].buffer


def test_evicting_a_parent_folds_its_piece_into_the_child_and_frees_its_state():
    """The parent's entry goes; its piece stays (the child holds it): what the store
    frees is the parent's own state, and the child still restores exactly."""
    a, b = _turns(lambda: [KVCache(), ArraysCache(size=1)], [10, 30])
    state = 3 * D * 4
    store = PromptCache(1 << 30)
    store.insert("m", list(range(10)), a, CheckpointKind.LAST_MESSAGE)
    store.insert("m", list(range(30)), b, CheckpointKind.LAST_MESSAGE)
    assert store.stats().bytes == 30 * TOKEN + 2 * state
    parent = next(e for e in store.entries() if e.tokens == 10)
    assert store.evict_entry("m", parent.entry_id).value == "evicted"
    assert store.stats().bytes == 30 * TOKEN + state  # only its state was freed
    store.check_integrity()
    before = _pieces(b)
    got = restore(store.get("m", list(range(30))))
    assert got[0].offset == 30 and all(
        np.array_equal(x, y) for x, y in zip(_pieces(b), before, strict=True)
    )


def test_a_running_requests_pieces_count_once_and_a_locked_chain_is_never_freed():
    """Invariant 6: a request restored from the child holds it (locked); its pieces,
    reported as shared, count once with the entries that hold them, and eviction under
    any budget frees nothing the request uses."""
    a, b = _turns(lambda: [KVCache()], [10, 30])
    store = PromptCache(1 << 30)
    store.insert("m", list(range(10)), a, CheckpointKind.SYSTEM)
    store.insert("m", list(range(30)), b, CheckpointKind.HISTORY)
    match = store.match("m", list(range(31)), lambda n: n)
    assert match.reuse_tokens == 30
    snap = store.acquire(match.entry_id)
    cache = restore(snap, extend=1)
    live = sum(c.nbytes for c in cache)
    store.set_active_bytes("req", live + snap.chain.nbytes, snap.chain.buffers)
    assert store.stats().bytes + store.stats().active_bytes == 30 * TOKEN + live
    store.set_budget(0)
    assert [e.tokens for e in store.entries()] == [30]  # the locked one stays
    assert store.stats().bytes == 30 * TOKEN
    store.release(match.entry_id)
    store.drop_active("req")
    assert store.stats().bytes == 0
    store.check_integrity()


def test_a_chain_is_saved_whole_and_loads_as_one_piece_later_turns_chain_onto(tmp_path):
    """The disk tier keeps whole files (about one copy of each token on disk); a file
    read back restores what the chain held, and a turn restored from it chains onto
    its arrays instead of copying them again."""
    from mlx_prefix.cache.disk.tier import DiskCache

    snaps = _turns(lambda: [KVCache(), ArraysCache(size=1)], [10, 15, 40])
    chain_snap = snaps[-1]
    disk = DiskCache(tmp_path)
    assert disk.save("m", list(range(40)), chain_snap, CheckpointKind.HISTORY)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 1.2 * chain_snap.nbytes + (64 << 10)
    match = DiskCache(tmp_path).match("m", list(range(41)), lambda n: n)
    loaded = DiskCache(tmp_path).load(match)
    assert loaded is not None and [(p.start, p.end) for p in loaded.chain.pieces] == [(0, 40)]
    assert loaded.nbytes == chain_snap.nbytes
    a, b = restore(loaded, extend=2), restore(chain_snap, extend=2)
    assert all(
        np.array_equal(np.array(x), np.array(y))
        for x, y in zip(_append(a, 2, 8), _append(b, 2, 8), strict=True)
    )
    # The next turn restored from the loaded file holds only what it adds.
    nxt = capture(a, 42, loaded.chain)
    assert nxt.chain.pieces[0].buffer == loaded.chain.pieces[0].buffer
    assert [(p.start, p.end) for p in nxt.chain.pieces] == [(0, 40), (40, 42)]


GRID = 16  # the chunk grid of the model tests below: every checkpoint lies on it


def _prefill(model, cache: list, tokens: list[int], start: int) -> dict[int, mx.array]:
    """Compute `tokens[start:]` into `cache` on the grid: each chunk's last logits."""
    out = {}
    ends = [*range(start - start % GRID + GRID, len(tokens), GRID), len(tokens)]
    for end in ends:
        out[end] = model(mx.array(tokens[start:end])[None], cache=cache)[:, -1, :]
        mx.eval(out[end])
        start = end
    return out


def _greedy(model, cache: list, logits: mx.array, n: int = 4) -> list[mx.array]:
    """`n` greedy decode steps from `logits`: the logits of each."""
    out = [logits]
    for _ in range(n):
        token = mx.argmax(out[-1], axis=-1)[:, None]
        out.append(model(token, cache=cache)[:, -1, :])
        mx.eval(out[-1])
    return out


def _computes_as_cold(model, snap: Snapshot, trim: int, tokens: list[int]) -> None:
    """A cache restored from `snap` (less `trim` tokens) computes the rest of `tokens`
    and four greedy steps exactly as a cold prefill of `tokens` on the same grid."""
    start = snap.length - trim
    warm = restore(snap, trim=trim, extend=GRID - start % GRID)
    warm_logits = _prefill(model, warm, tokens, start)
    cold = model.make_cache()
    cold_logits = _prefill(model, cold, tokens, 0)
    for end, logits in warm_logits.items():
        assert mx.array_equal(logits, cold_logits[end]), f"chunk ending at {end}"
    n = len(tokens)
    warm_steps = _greedy(model, warm, warm_logits[n])
    cold_steps = _greedy(model, cold, cold_logits[n])
    assert all(mx.array_equal(a, b) for a, b in zip(warm_steps, cold_steps, strict=True))


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_evicting_the_middle_of_three_links_frees_its_own_state_and_both_ends_stay_exact(kind):
    """Three entries of one conversation, each restored from the one before and
    continuing its chain, on a real model: the middle one evicted, its piece stays (the
    third holds it) and only its own state is freed (none for a dense model, its
    recurrent state for a hybrid); the first and the third still restore and compute
    what a cold prefill computes, bit for bit, and a prompt that followed the middle
    one's path restores from what is left."""
    from support.models import loaded_test_model

    from mlx_prefix.config import CacheConfig
    from mlx_prefix.engine.parts import new_store

    loaded = loaded_test_model(kind)
    model = loaded.model
    text = "The river bends north at the old mill, then east past the lamp. " * 8
    tokens = loaded.tokenizer.encode(text)[:100]
    assert len(tokens) == 100
    ends = (32, 64, 96)  # the three links, on the grid
    cache = model.make_cache()
    _prefill(model, cache, tokens[: ends[0]], 0)
    snaps = [capture(cache, ends[0])]
    for end in ends[1:]:
        prev = snaps[-1]
        cache = restore(prev, extend=GRID)
        _prefill(model, cache, tokens[:end], prev.length)
        snaps.append(capture(cache, end, prev.chain))
    first, middle, third = snaps
    assert [(p.start, p.end) for p in third.chain.pieces] == [(0, 32), (32, 64), (64, 96)]
    assert third.chain.pieces[:2] == middle.chain.pieces
    own = [s.nbytes - s.chain.nbytes for s in snaps]  # each one's state besides its KV
    assert (own[0] > 0) == (kind == "qwen3_5")

    store = new_store(CacheConfig(budget_bytes=1 << 30))
    kinds = (CheckpointKind.SYSTEM, CheckpointKind.BREAKPOINT, CheckpointKind.LAST_MESSAGE)
    for s, k in zip(snaps, kinds, strict=True):  # kinds that keep a dense model's prefixes
        assert store.insert("m", tokens[: s.length], s, k)
    assert store.stats().bytes == third.nbytes + own[0] + own[1]
    ids = {e.tokens: e.entry_id for e in store.entries()}
    assert store.evict_entry("m", ids[64]) == EvictOutcome.EVICTED

    # The bytes: what the middle held alone (its state) is freed, its piece is not.
    stats = store.stats()
    assert (stats.entries, stats.bytes) == (2, third.nbytes + own[0])
    assert stats.bytes_by_kind["SYSTEM"] == first.nbytes
    assert stats.bytes_by_kind["LAST_MESSAGE"] == third.nbytes - first.chain.nbytes
    assert stats.bytes_by_kind["BREAKPOINT"] == 0
    info = {e.tokens: e for e in store.entries()}
    assert info[32].shared_bytes == info[96].shared_bytes == first.chain.nbytes
    resident = store._contents.table.resident
    assert resident.holders(middle.chain.pieces[1].buffer.key) == {ids[96]}
    assert resident.total == stats.bytes
    store.check_integrity()

    # Both ends restore exactly.
    whole = tokens + loaded.tokenizer.encode(" And the lamp?")
    match = store.match("m", whole, lambda n: n - n % GRID)
    assert (match.entry_id, match.reuse_tokens) == (ids[96], 96)
    _computes_as_cold(model, store.acquire(match.entry_id), match.trim, whole)
    store.release(match.entry_id)
    _computes_as_cold(model, store.get("m", tokens[:32]), 0, whole)
    # A prompt that left at the middle's end: a hybrid now restores from the first (it
    # reused the middle before), a dense model from the third cut back to there.
    other = tokens[:64] + loaded.tokenizer.encode(" Where is the mill?") * 2
    match = store.match("m", other, lambda n: n - n % GRID)
    expected = (ids[32], 32) if kind == "qwen3_5" else (ids[96], 64)
    assert (match.entry_id, match.reuse_tokens) == expected
    _computes_as_cold(model, store.acquire(match.entry_id), match.trim, other)
    store.release(match.entry_id)
    store.check_integrity()
