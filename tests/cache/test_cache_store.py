from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest
from support.cache_sim import FakeSnapshot

from mlx_prefix.cache.eviction.policy import policy_named
from mlx_prefix.cache.store import CacheMatch, CheckpointKind, PromptCache
from mlx_prefix.cache.types import Buffer, new_buffer_key
from mlx_prefix.config import EVICTION_POLICIES

K = CheckpointKind
M = "model-a"


def snap(tokens, trimmable=True, nbytes=10) -> FakeSnapshot:
    return FakeSnapshot(len(tokens), trimmable, nbytes)


def every(n: int):
    return lambda x: x


def grid(step: int):
    return lambda x: x // step * step


ident = every(1)
seq = list(range(100, 140))  # 40 distinct tokens


def test_miss_on_empty_and_on_other_model():
    c = PromptCache(1000)
    assert c.match(M, seq, ident) == CacheMatch(None, 0, 0, 0)
    assert c.insert(M, seq[:20], snap(seq[:20]), K.HISTORY)
    m = c.match("model-b", seq, ident)
    assert m.entry_id is None and m.reuse_tokens == 0
    assert c.match(M, seq, ident).entry_id is not None
    s = c.stats()
    assert (s.hits, s.misses) == (1, 2)
    c.check_integrity()


def test_trimmable_partial_reuse_trims_the_tail():
    c = PromptCache(1000)
    stored = seq[:30]
    c.insert(M, stored, snap(stored), K.HISTORY)
    query = seq[:25] + [1, 2, 3]
    m = c.match(M, query, ident)
    assert m.entry_id is not None
    assert (m.reuse_tokens, m.trim, m.matched_tokens) == (25, 5, 25)
    assert c.acquire(m.entry_id).length == 30
    c.release(m.entry_id)
    c.check_integrity()


def test_alignment_applied_to_trimmable_reuse():
    c = PromptCache(1000)
    c.insert(M, seq[:30], snap(seq[:30]), K.HISTORY)
    m = c.match(M, seq[:23] + [7, 7], grid(8))
    assert (m.reuse_tokens, m.trim, m.matched_tokens) == (16, 14, 23)
    m = c.match(M, seq[:5] + [7], grid(8))  # aligns to 0: a miss
    assert m.entry_id is None and m.matched_tokens == 5
    c.check_integrity()


def test_exact_full_hit_leaves_one_token_to_compute():
    c = PromptCache(1000)
    c.insert(M, seq[:20], snap(seq[:20]), K.HISTORY)
    m = c.match(M, seq[:20], ident)
    assert (m.reuse_tokens, m.trim) == (19, 1)
    # Non-trimmable: the entry equal to the prompt is unusable, a shorter one is.
    c2 = PromptCache(1000)
    c2.insert(M, seq[:20], snap(seq[:20], trimmable=False), K.HISTORY)
    assert c2.match(M, seq[:20], ident).entry_id is None
    c2.insert(M, seq[:12], snap(seq[:12], trimmable=False), K.SYSTEM)
    m = c2.match(M, seq[:20], ident)
    assert (m.reuse_tokens, m.trim) == (12, 0)
    assert c.match(M, seq[:1], ident).entry_id is None  # one token: nothing to reuse
    c.check_integrity()
    c2.check_integrity()


def test_non_trimmable_exact_prefix_only_with_longest_shorter_fallback():
    c = PromptCache(1000)
    for n in (8, 16, 24):
        assert c.insert(M, seq[:n], snap(seq[:n], trimmable=False), K.PERIODIC)
    # Diverges at 20: the 24-token checkpoint is not a prefix, fall back to 16.
    m = c.match(M, seq[:20] + [1, 2, 3], grid(8))
    assert (m.reuse_tokens, m.trim, m.matched_tokens) == (16, 0, 20)
    assert c.acquire(m.entry_id).length == 16
    c.release(m.entry_id)
    # Extends past 24: the 24 checkpoint wins.
    m = c.match(M, seq[:30], grid(8))
    assert (m.reuse_tokens, m.trim) == (24, 0)
    # Diverges before 8: a miss even though 5 tokens match.
    m = c.match(M, seq[:5] + [1, 2, 3], grid(8))
    assert m.entry_id is None and m.matched_tokens == 5
    # A checkpoint off the grid is never used.
    c.insert(M, seq[:27], snap(seq[:27], trimmable=False), K.PERIODIC)
    assert c.match(M, seq[:30], grid(8)).reuse_tokens == 24
    c.check_integrity()


def test_largest_reuse_wins_between_kinds_of_entry():
    c = PromptCache(1000)
    c.insert(M, seq[:16], snap(seq[:16], trimmable=False), K.SYSTEM)
    c.insert(M, [*seq[:22], 5, 5], snap(seq[:24], trimmable=True), K.HISTORY)
    m = c.match(M, seq[:30], ident)
    assert (m.reuse_tokens, m.trim) == (22, 2)
    m = c.match(M, seq[:30], grid(16))  # the trimmable aligns down to 16: tie, no trim wins
    assert (m.reuse_tokens, m.trim) == (16, 0)
    assert c.acquire(m.entry_id).trimmable is False
    c.release(m.entry_id)
    c.check_integrity()


def test_recency_refresh_changes_the_eviction_victim():
    c = PromptCache(30)
    a, b, d = [1] * 5, [2] * 5, [3] * 5
    c.insert(M, a, snap(a), K.HISTORY)
    c.insert(M, b, snap(b), K.HISTORY)
    c.insert(M, d, snap(d), K.HISTORY)
    m = c.match(M, [*a, 9], ident)
    c.acquire(m.entry_id)
    c.release(m.entry_id)  # a is now the most recent; b is the LRU
    c.insert(M, [4] * 5, snap([4] * 5), K.HISTORY)
    assert c.match(M, [*b, 9], ident).entry_id is None
    assert c.match(M, [*a, 9], ident).entry_id is not None
    assert c.stats().evictions == 1
    c.check_integrity()


def test_eviction_order_by_kind_then_lru():
    c = PromptCache(40)
    c.insert(M, [1] * 4, snap([1] * 4), K.SYSTEM)
    c.insert(M, [2] * 4, snap([2] * 4), K.PERIODIC)
    c.insert(M, [3] * 4, snap([3] * 4), K.LAST_MESSAGE)
    c.insert(M, [4] * 4, snap([4] * 4), K.PERIODIC)
    order = [e.tokens for e in c.entries()]
    assert [e.kind for e in c.entries()] == [K.PERIODIC, K.PERIODIC, K.LAST_MESSAGE, K.SYSTEM]
    assert order == [4, 4, 4, 4]
    c.insert(M, [5] * 4, snap([5] * 4), K.HISTORY)  # evicts [2]*4 (oldest PERIODIC)
    c.insert(M, [6] * 4, snap([6] * 4), K.HISTORY)  # then [4]*4
    c.insert(M, [7] * 4, snap([7] * 4), K.HISTORY)  # then the oldest HISTORY, [5]*4
    left = {(e.kind, e.entry_id) for e in c.entries()}
    assert {k for k, _ in left} == {K.SYSTEM, K.LAST_MESSAGE, K.HISTORY}
    for gone in ([2] * 4, [4] * 4, [5] * 4):
        assert c.match(M, [*gone, 0], ident).entry_id is None
    for kept in ([1] * 4, [3] * 4, [6] * 4, [7] * 4):
        assert c.match(M, [*kept, 0], ident).entry_id is not None
    assert c.stats().evictions == 3
    c.check_integrity()


@dataclass(frozen=True, slots=True)
class SharingSnapshot:
    length: int
    trimmable: bool
    nbytes: int
    buffers: tuple[Buffer, ...]


def shares(tokens, *buffers: Buffer) -> SharingSnapshot:
    return SharingSnapshot(len(tokens), True, sum(b.nbytes for b in buffers), buffers)


def test_a_live_cache_sharing_a_stored_entrys_buffer_counts_it_once():
    c = PromptCache(100)
    kv = Buffer(new_buffer_key(), 50)  # the prefill cache's KV, which its end snapshot views
    c.set_active_bytes("r", 60, [kv])  # 50 shared + 10 of its own, no entry holds kv yet
    assert (c.stats().bytes, c.stats().active_bytes) == (0, 60)
    assert c.insert(M, seq[:10], shares(seq[:10], kv), K.HISTORY)
    s = c.stats()
    assert (s.bytes, s.active_bytes) == (50, 10)  # used 60, not 110
    # Room for 40 more: the end is not evicted to make room for what it shares.
    assert c.insert(M, seq[20:30], snap(seq[20:30], nbytes=40), K.HISTORY)
    assert c.stats().entries == 2 and c.stats().evictions == 0
    c.check_integrity()


def test_evicting_a_shared_entry_frees_nothing_while_the_request_runs():
    c = PromptCache(100)
    kv = Buffer(new_buffer_key(), 50)
    c.set_active_bytes("r", 50, [kv])
    c.insert(M, seq[:10], shares(seq[:10], kv), K.HISTORY)
    c.insert(M, seq[20:30], snap(seq[20:30], nbytes=30), K.SYSTEM)
    assert c.evict_entry(M, c.match(M, seq[:11], ident).entry_id).value == "evicted"
    s = c.stats()
    assert (s.bytes, s.active_bytes) == (30, 50)  # still 80 used: the request holds kv
    # So 21 more bytes do not fit with the request running...
    assert not c.insert(M, seq[30:40], snap(seq[30:40], nbytes=21), K.PERIODIC)
    c.drop_active("r")  # ...and do once it is gone, which frees kv
    assert (c.stats().bytes, c.stats().active_bytes) == (30, 0)
    assert c.insert(M, seq[30:40], snap(seq[30:40], nbytes=21), K.PERIODIC)
    c.check_integrity()


def test_a_shared_buffer_stays_stored_after_its_request_ends():
    c = PromptCache(100)
    kv = Buffer(new_buffer_key(), 50)
    c.set_active_bytes("r", 70, [kv])
    c.insert(M, seq[:10], shares(seq[:10], kv), K.HISTORY)
    c.set_active_bytes("r2", 50, [kv])  # another request sharing it: still counted once
    assert c.stats().bytes + c.stats().active_bytes == 70
    c.drop_active("r")
    c.drop_active("r2")
    s = c.stats()
    assert (s.bytes, s.active_bytes, s.entries, s.active_requests) == (50, 0, 1, 0)
    with pytest.raises(ValueError):  # shared buffers are part of what it reports
        c.set_active_bytes("r", 49, [kv])
    c.check_integrity()


def test_budget_counts_active_request_bytes():
    c = PromptCache(100)
    for i in range(5):
        c.insert(M, [i] * 3, snap([i] * 3, nbytes=20), K.HISTORY)
    assert c.stats().bytes == 100
    c.set_active_bytes("r1", 45)  # needs 3 evictions: 60 + 45 > 100 until 40 + 45
    s = c.stats()
    assert (s.bytes, s.active_bytes, s.entries, s.evictions) == (40, 45, 2, 3)
    c.check_integrity()
    c.set_active_bytes("r1", 25)  # shrinking frees nothing back, evicts nothing
    assert c.stats().entries == 2
    c.set_active_bytes("r2", 40)
    assert c.stats().bytes + c.stats().active_bytes <= 100
    c.drop_active("r1")
    c.drop_active("r2")
    c.drop_active("never-seen")
    assert c.stats().active_bytes == 0 and c.stats().active_requests == 0
    assert c.insert(M, [9] * 3, snap([9] * 3, nbytes=101), K.SYSTEM) is False  # > budget
    c.check_integrity()


def test_pinned_entries_never_evicted():
    c = PromptCache(30)
    sys_prompt = [7] * 6
    assert c.pin(M, sys_prompt) is False  # a pin may precede the entry
    c.insert(M, sys_prompt, snap(sys_prompt), K.PERIODIC)
    assert c.pin(M, sys_prompt) is True
    for i in range(10):
        c.insert(M, [i] * 2, snap([i] * 2), K.SYSTEM)
        c.check_integrity()
    assert c.match(M, [*sys_prompt, 1], ident).reuse_tokens == 6
    c.set_active_bytes("r", 1000)  # everything else goes; the pin stays, over budget
    assert [e.pinned for e in c.entries()] == [True]
    c.check_integrity()  # over budget is fine when only pinned entries are left
    c.drop_active("r")
    assert c.unpin(M, sys_prompt) is True and c.unpin(M, sys_prompt) is False
    c.set_active_bytes("r", 1000)
    assert c.stats().entries == 0
    c.check_integrity()


def test_locked_entries_never_evicted():
    c = PromptCache(30)
    c.insert(M, [1] * 4, snap([1] * 4), K.PERIODIC)
    m = c.match(M, [1] * 5, ident)
    payload = c.acquire(m.entry_id)
    assert payload.length == 4
    for i in range(2, 6):
        c.insert(M, [i] * 4, snap([i] * 4), K.SYSTEM)
    assert c.stats().locked == 1
    assert c.match(M, [1] * 5, ident).entry_id == m.entry_id
    c.set_active_bytes("r", 1000)
    assert [e.entry_id for e in c.entries()] == [m.entry_id]
    c.check_integrity()
    assert c.clear() == 0  # locked entries survive a flush
    c.release(m.entry_id)  # over budget: the release lets it go
    assert c.stats().entries == 0
    c.check_integrity()
    with pytest.raises(AssertionError):
        c.release(m.entry_id)


def test_insert_larger_than_everything_evictable_is_refused():
    c = PromptCache(30)
    c.insert(M, [1] * 2, snap([1] * 2, nbytes=20), K.SYSTEM)
    c.pin(M, [1] * 2)
    assert c.insert(M, [2] * 2, snap([2] * 2, nbytes=20), K.SYSTEM) is False
    assert c.stats().entries == 1
    c.check_integrity()


def test_trimmable_redundancy():
    c = PromptCache(1000)
    assert c.insert(M, seq[:10], snap(seq[:10]), K.HISTORY)
    assert c.insert(M, seq[:20], snap(seq[:20]), K.HISTORY)  # drops the 10 prefix
    assert [e.tokens for e in c.entries()] == [20]
    assert c.insert(M, seq[:15], snap(seq[:15]), K.PERIODIC) is False  # redundant
    # A higher-kind prefix is kept: it outlives the lower-kind extension.
    assert c.insert(M, seq[:12], snap(seq[:12]), K.SYSTEM) is True
    assert c.insert(M, seq[:25], snap(seq[:25]), K.PERIODIC) is True  # lower kind: 20 stays
    assert sorted(e.tokens for e in c.entries()) == [12, 20, 25]
    assert c.insert(M, seq[:30], snap(seq[:30]), K.HISTORY) is True
    assert sorted(e.tokens for e in c.entries()) == [12, 30]  # 20 and 25 went, 12 stayed
    # Pinned and locked prefixes stay.
    c.pin(M, seq[:5])
    assert c.insert(M, seq[:5], snap(seq[:5]), K.PERIODIC) is True
    m = c.match(M, [*seq[:12], 0], ident)
    c.acquire(m.entry_id)
    assert c.insert(M, seq[:35], snap(seq[:35]), K.SYSTEM) is True
    assert sorted(e.tokens for e in c.entries()) == [5, 12, 35]
    c.release(m.entry_id)
    # Non-trimmable prefixes are never redundant.
    c.insert(M, [1, 2], snap([1, 2], trimmable=False), K.PERIODIC)
    c.insert(M, [1, 2, 3, 4], snap([1, 2, 3, 4], trimmable=False), K.PERIODIC)
    assert c.stats().entries == 5
    c.check_integrity()


def test_duplicate_insert_refreshes():
    c = PromptCache(30)
    first = snap([1] * 3)
    c.insert(M, [1] * 3, first, K.PERIODIC)
    c.insert(M, [2] * 3, snap([2] * 3), K.PERIODIC)
    assert c.insert(M, [1] * 3, snap([1] * 3), K.HISTORY) is True  # refresh + kind upgrade
    assert c.stats().entries == 2 and c.stats().bytes == 20
    info = {e.tokens: e for e in c.entries() if e.tokens == 3}
    assert info[3].kind == K.HISTORY
    c.insert(M, [3] * 3, snap([3] * 3), K.PERIODIC)
    c.insert(M, [4] * 3, snap([4] * 3), K.PERIODIC)  # evicts [2]*3, not the refreshed one
    m = c.match(M, [1] * 4, ident)
    assert c.acquire(m.entry_id) is first
    c.release(m.entry_id)
    assert c.match(M, [2] * 4, ident).entry_id is None
    c.check_integrity()


def test_max_entries():
    c = PromptCache(10_000, max_entries=3)
    for i in range(5):
        c.insert(M, [i] * 2, snap([i] * 2), K.HISTORY)
    assert [e.tokens for e in c.entries()] == [2, 2, 2]
    assert c.match(M, [0] * 3, ident).entry_id is None
    assert c.match(M, [4] * 3, ident).entry_id is not None
    c.check_integrity()


def test_clear_one_model_or_all():
    c = PromptCache(1000)
    c.insert(M, [1] * 3, snap([1] * 3), K.SYSTEM)
    c.pin(M, [1] * 3)
    c.insert(M, [2] * 3, snap([2] * 3), K.SYSTEM)
    c.insert("b", [1] * 3, snap([1] * 3), K.SYSTEM)
    assert c.clear(M) == 2
    assert c.match(M, [1] * 4, ident).entry_id is None
    assert c.match("b", [1] * 4, ident).entry_id is not None
    assert c.stats().pinned == 0
    assert c.clear() == 1
    assert c.stats().entries == 0 and c.stats().bytes == 0
    c.check_integrity()


def test_stats_counters_and_entry_info():
    now = [100.0]
    c = PromptCache(1000, clock=lambda: now[0])
    c.insert(M, seq[:10], snap(seq[:10], nbytes=7), K.SYSTEM)
    c.insert(M, [1] * 4, snap([1] * 4, trimmable=False, nbytes=5), K.PERIODIC)
    now[0] = 103.0
    m = c.match(M, seq[:14], ident)
    c.acquire(m.entry_id)
    now[0] = 104.5
    c.match(M, [9, 9], ident)
    s = c.stats()
    assert (s.hits, s.misses, s.tokens_reused) == (1, 1, 10)
    assert (s.entries, s.bytes, s.locked, s.budget_bytes) == (2, 12, 1, 1000)
    assert s.bytes_by_kind["SYSTEM"] == 7 and s.bytes_by_kind["PERIODIC"] == 5
    assert s.entries_by_kind["HISTORY"] == 0 and "GENERATED" not in s.entries_by_kind
    info = {e.kind: e for e in c.entries()}
    sys_e = info[K.SYSTEM]
    assert (sys_e.tokens, sys_e.nbytes, sys_e.hits, sys_e.refs, sys_e.model_key) == (10, 7, 1, 1, M)
    assert sys_e.age_s == pytest.approx(4.5) and sys_e.idle_s == pytest.approx(1.5)
    assert info[K.PERIODIC].trimmable is False and info[K.PERIODIC].hits == 0
    c.release(m.entry_id)
    c.check_integrity()


def test_acquire_after_concurrent_clear_is_a_miss():
    c = PromptCache(1000)
    c.insert(M, [1] * 3, snap([1] * 3), K.SYSTEM)
    m = c.match(M, [1] * 4, ident)
    c.clear()
    assert c.acquire(m.entry_id) is None


def test_payload_length_must_match_tokens():
    c = PromptCache(1000)
    with pytest.raises(ValueError):
        c.insert(M, [1, 2, 3], FakeSnapshot(2), K.SYSTEM)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_cancelled_prefills_entry_goes_first_and_never_pushes_one_out(policy):
    """CANCELLED (issue 55): stored only into room nobody else wants, evicted before
    any other kind whatever its value."""
    c = PromptCache(40, policy=policy_named(policy))
    for i, kind in enumerate((K.PERIODIC, K.HISTORY, K.SYSTEM)):
        c.insert(M, [i] * 4, snap([i] * 4), kind)
    assert c.insert(M, [7] * 4, snap([7] * 4), K.CANCELLED)  # room left: stored
    assert not c.insert(M, [8] * 4, snap([8] * 4, nbytes=20), K.CANCELLED)  # none: refused
    assert {e.kind for e in c.entries()} == {K.PERIODIC, K.HISTORY, K.SYSTEM, K.CANCELLED}
    hit = c.match(M, [7] * 5, ident).entry_id
    c.acquire(hit)  # now the most recently used
    c.release(hit)
    assert c.insert(M, [9] * 4, snap([9] * 4), K.PERIODIC)  # the cancelled one goes first
    assert K.CANCELLED not in {e.kind for e in c.entries()} and c.stats().entries == 4
    c.check_integrity()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_random_operations_keep_integrity_and_reuse_rules(policy):
    rng = random.Random(1)
    c = PromptCache(400, max_entries=12, policy=policy_named(policy))
    shared = [Buffer(new_buffer_key(), rng.randrange(1, 80)) for _ in range(4)]
    locked: list[int] = []
    align = grid(2)
    for _ in range(2000):
        model = rng.choice(["a", "b"])
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        op = rng.random()
        if op < 0.45:
            trimmable = rng.random() < 0.5
            payload = snap(toks, trimmable=trimmable, nbytes=rng.randrange(1, 60))
            if rng.random() < 0.4:  # holds a buffer other entries may hold too
                buffers = (rng.choice(shared), Buffer(new_buffer_key(), rng.randrange(1, 20)))
                size = sum(b.nbytes for b in buffers)
                payload = SharingSnapshot(len(toks), trimmable, size, buffers)
            c.insert(model, toks, payload, rng.choice(list(K)))
        elif op < 0.8:
            m = c.match(model, toks, align)
            if m.entry_id is not None:
                assert 0 < m.reuse_tokens <= len(toks) - 1
                assert align(m.reuse_tokens) == m.reuse_tokens
                p = c.acquire(m.entry_id)
                assert p.length - m.trim == m.reuse_tokens
                assert m.trim == 0 or p.trimmable
                locked.append(m.entry_id)
        elif op < 0.9 and locked:
            c.release(locked.pop(rng.randrange(len(locked))))
        elif op < 0.95:
            live = rng.sample(shared, rng.randrange(3))  # its live cache may share some
            own = rng.randrange(0, 200)
            c.set_active_bytes(rng.choice("xyz"), own + sum(b.nbytes for b in live), live)
        elif op < 0.97:
            c.pin(model, toks)
        else:
            c.unpin(model, toks)
        c.check_integrity()
    for i in locked:
        c.release(i)
    c.check_integrity()


def test_threads_share_one_store():
    c = PromptCache(10_000)

    def worker(k: int) -> None:
        for i in range(200):
            t = [k, i % 7, i % 5]
            c.insert(M, t, snap(t), K.HISTORY)
            m = c.match(M, [*t, 0], ident)
            if m.entry_id is not None and c.acquire(m.entry_id) is not None:
                c.release(m.entry_id)
            c.stats()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.check_integrity()
    assert c.stats().hits > 0


def test_a_refused_insert_changes_nothing():
    # The new entry cannot fit (the pinned entry and its own size fill the budget): the
    # prefix it would have made redundant must stay, and nothing else is evicted for it.
    c = PromptCache(100)
    c.insert(M, [7] * 3, snap([7] * 3, nbytes=50), K.SYSTEM)
    c.pin(M, [7] * 3)
    assert c.insert(M, seq[:10], snap(seq[:10], nbytes=40), K.PERIODIC)
    assert c.insert(M, seq[:20], snap(seq[:20], nbytes=60), K.PERIODIC) is False
    assert c.match(M, seq[:15], ident).reuse_tokens == 10
    assert c.stats().evictions == 0 and c.stats().entries == 2
    c.check_integrity()


def test_sequences_list_one_model_key_with_its_tokens_and_change_nothing():
    c = PromptCache(1000, clock=lambda: 5.0)
    c.insert(M, seq[:10], snap(seq[:10], trimmable=False), K.SYSTEM)
    c.insert(M, seq[:30], snap(seq[:30], trimmable=False), K.HISTORY)
    c.insert("model-b", seq[:20], snap(seq[:20]), K.HISTORY)
    before = (c.stats(), c.entries())
    listed = c.sequences(M)
    assert [s.tokens for s in listed] == [tuple(seq[:30]), tuple(seq[:10])]  # eviction order
    assert [s.info.tokens for s in listed] == [30, 10]
    assert {s.info.model_key for s in listed} == {M}
    assert (c.stats(), c.entries()) == before  # no hit, no recency change
    assert c.sequences("model-c") == []


def test_set_pinned_by_entry_id_keeps_it_through_pressure_and_unpin_lets_it_go():
    c = PromptCache(30)
    c.insert(M, seq[:5], snap(seq[:5], trimmable=False), K.PERIODIC)
    (entry,) = c.entries()
    assert not c.set_pinned("model-b", entry.entry_id, True)  # another model's namespace
    assert not c.set_pinned(M, entry.entry_id + 99, True)
    assert c.set_pinned(M, entry.entry_id, True)
    assert c.entries()[0].pinned
    others = []
    for i in range(2):
        c.insert(M, [7, i], snap([7, i], trimmable=False), K.SYSTEM)
        others.append(c.match(M, [7, i, 0], ident).entry_id)
        assert c.acquire(others[-1]) is not None  # a running request holds it
    c.set_active_bytes("req", 10)  # over budget; the pinned entry still stays
    assert entry.entry_id in {e.entry_id for e in c.entries()}
    assert c.set_pinned(M, entry.entry_id, False)
    assert entry.entry_id not in {e.entry_id for e in c.entries()}  # unpinning evicted it
    assert c.stats().evictions == 1
    for entry_id in others:
        c.release(entry_id)
    c.check_integrity()


def test_evict_entry_refuses_locked_and_pinned_entries():
    from mlx_prefix.cache.types import EvictOutcome

    c = PromptCache(1000)
    c.insert(M, seq[:10], snap(seq[:10], trimmable=False), K.SYSTEM)
    c.insert(M, seq[:20], snap(seq[:20], trimmable=False), K.HISTORY)
    system, history = sorted(c.entries(), key=lambda e: e.tokens)
    assert c.evict_entry("model-b", system.entry_id) is EvictOutcome.MISSING
    c.pin(M, seq[:10])
    assert c.evict_entry(M, system.entry_id) is EvictOutcome.PINNED
    assert c.acquire(history.entry_id) is not None
    assert c.evict_entry(M, history.entry_id) is EvictOutcome.LOCKED
    c.release(history.entry_id)
    assert c.evict_entry(M, history.entry_id) is EvictOutcome.EVICTED
    assert c.evict_entry(M, history.entry_id) is EvictOutcome.MISSING
    assert [e.entry_id for e in c.entries()] == [system.entry_id]
    assert c.stats().evictions == 0  # an asked-for removal, like clear(), is not counted
    m = c.match(M, seq[:25], ident)
    assert m.reuse_tokens == 10  # the evicted history no longer serves
    c.check_integrity()


def test_pinned_flags_follow_the_pins_through_insert_unpin_and_clear():
    c = PromptCache(1000)
    c.pin(M, seq[:10])  # before the entry exists: the pin covers it once inserted
    c.insert(M, seq[:10], snap(seq[:10], trimmable=False), K.PERIODIC)
    c.insert(M, seq[:20], snap(seq[:20], trimmable=False), K.PERIODIC)
    assert {e.tokens: e.pinned for e in c.entries()} == {10: True, 20: False}
    assert c.stats().pinned == 1
    c.check_integrity()
    held = c.match(M, seq[:11], ident).entry_id
    assert c.acquire(held) is not None
    assert c.clear(M) == 1  # the locked entry stays, its pin goes
    (left,) = c.entries()
    assert left.entry_id == held and not left.pinned
    c.check_integrity()
    c.release(held)
    assert c.pin(M, seq[:10]) and c.entries()[0].pinned
    assert c.unpin(M, seq[:10]) and not c.entries()[0].pinned
    c.check_integrity()


def test_one_namespace_pins_at_most_its_share_and_others_keep_inserting():
    from mlx_prefix.errors import PinQuotaExceeded

    a, a_salted, a_other_model, b = "m/ns-a", "m/ns-a/salt", "m2/ns-a", "m/ns-b"
    c = PromptCache(100, pin_share=0.3)
    for i, key in enumerate((a, a_salted)):
        seq = [i + 1] * 4
        assert c.insert(key, seq, snap(seq), K.SYSTEM)
        assert c.pin(key, seq) is True  # 10 + 10 bytes pinned by ns-a
    third = [3] * 4
    assert c.insert(a_other_model, third, snap(third), K.SYSTEM)
    assert c.pin_stored(a_other_model, [third, [9] * 4]) == 1  # 30: the whole share
    fourth = [4] * 4
    assert c.insert(a, fourth, snap(fourth), K.SYSTEM)
    with pytest.raises(PinQuotaExceeded, match="--pin-share 0.3"):
        c.pin(a, fourth)
    entry = next(e for e in c.entries() if e.model_key == a and not e.pinned)
    with pytest.raises(PinQuotaExceeded):
        c.set_pinned(a, entry.entry_id, True)
    with pytest.raises(PinQuotaExceeded):
        c.pin_stored(a, [fourth])
    assert [e.pinned for e in c.entries() if e.model_key == a] == [True, False]  # unchanged
    # The pin refused, ns-a's fourth entry stays evictable, and ns-b keeps inserting.
    for i in range(10, 20):
        seq = [i] * 4
        assert c.insert(b, seq, snap(seq), K.SYSTEM)
        c.check_integrity()
    assert c.pin(b, [19] * 4) is True  # its own share
    c.check_integrity()


def test_a_pin_before_its_entry_does_not_overrun_the_share():
    c = PromptCache(100, pin_share=0.1)
    first, second = [1] * 4, [2] * 4
    assert c.insert("m/a", first, snap(first), K.SYSTEM) and c.pin("m/a", first)
    assert c.pin("m/a", second) is False  # no entry yet
    assert c.insert("m/a", second, snap(second), K.SYSTEM)
    assert [e.pinned for e in c.entries()] == [True, False]
    c.check_integrity()


def test_shared_buffers_count_once_against_the_share():
    shared = Buffer(new_buffer_key(), 20)  # one prefill's KV, held by both checkpoints
    c = PromptCache(100, pin_share=0.3)
    for n in (4, 8):
        s = SharingSnapshot(n, False, 23, (shared, Buffer(new_buffer_key(), 3)))
        assert c.insert("m/a", [5] * n, s, K.SYSTEM)
    assert c.pin_stored("m/a", [[5] * 4, [5] * 8]) == 2  # 26 bytes held, not 46
    c.check_integrity()


def _conversation_turn(c: PromptCache, prior: list[int], longer: list[int], kv: int) -> list[int]:
    """One turn of a conversation as the engine runs it under a tight budget: restore
    `prior` (kv bytes per token), hold a live copy that grows to `longer`, store `longer`
    from that same buffer at the end. Returns stored + active bytes after each step."""
    used: list[int] = []

    def step() -> None:
        s = c.stats()
        used.append(s.bytes + s.active_bytes)

    m = c.match(M, longer, ident)
    need = 2 * len(longer) * kv - len(prior) * kv  # the live copy, then its end piece
    assert m.entry_id is not None
    payload = c.hand_over(m.entry_id, lambda p: need) or c.acquire(m.entry_id)
    assert payload is not None
    step()
    live = Buffer(new_buffer_key(), len(longer) * kv)
    c.set_active_bytes("r", live.nbytes, [live])  # its copy of `prior`, then the rest
    step()
    assert c.insert(M, longer, shares(longer, live), K.HISTORY)  # the same buffer: no copy
    step()
    if not c.stats().handed_over:
        c.release(m.entry_id)
    c.drop_active("r")
    step()
    c.check_integrity()
    return used


def test_a_tight_budget_hands_the_entry_to_the_request_that_extends_it():
    # 190 MiB and an 88 MiB conversation (issue 55): the request restoring the entry
    # holds a copy of it; two copies do not fit, so the store gives the entry to the
    # request (removed, not evicted: nothing else goes) and its end stores the longer one.
    kv, budget = 10, 125 * 10 * 5 // 4  # 1.25x the final conversation of 125 tokens
    c = PromptCache(budget)
    first = list(range(1000, 1060))
    c.insert(M, first, shares(first, Buffer(new_buffer_key(), len(first) * kv)), K.HISTORY)
    prior = first
    for turn in range(2, 5):
        longer = prior + list(range(turn * 100, turn * 100 + 20))
        for used in _conversation_turn(c, prior, longer, kv):
            assert used <= budget  # a true cap at every step
        assert c.match(M, [*longer, 0], ident).reuse_tokens == len(longer)
        prior = longer
    s = c.stats()
    assert (s.entries, s.evictions, s.handed_over) == (1, 0, 3)
    assert len(c.evicted) == 0  # nothing evicted, nothing refused for room


def test_an_entry_that_fits_beside_its_copy_stays_stored():
    c = PromptCache(10_000)
    first = list(range(1000, 1060))
    c.insert(M, first, snap(first, nbytes=600), K.HISTORY)
    entry = c.match(M, [*first, 1], ident).entry_id
    assert entry is not None
    assert c.hand_over(entry, lambda p: 2000) is None  # room for both: shared, not handed over
    assert c.stats().entries == 1
    c.set_pinned(M, entry, True)
    assert c.hand_over(entry, lambda p: 20_000) is None  # a pinned entry is never handed over
    c.set_pinned(M, entry, False)
    assert c.acquire(entry) is not None
    assert c.hand_over(entry, lambda p: 20_000) is None  # nor one another request holds
    c.release(entry)
    assert c.hand_over(entry, lambda p: None) is None  # a payload it never hands over
    assert c.hand_over(entry, lambda p: 20_000) is not None
    assert c.stats().entries == 0 and c.stats().evictions == 0
    c.check_integrity()
