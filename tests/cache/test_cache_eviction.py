"""The eviction policies (cache/eviction/policy.py): ValueLRU's order, and a deterministic
simulation showing it saves more prefill than the kind order on a mixed workload."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from support import trace_sim
from support.cache_sim import DENSE, HYBRID, mixed_workload, simulate

from mlx_prefix.cache.eviction.policy import Candidate, KindLRU, ValueLRU
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.types import CheckpointKind

K = CheckpointKind
GiB = 1 << 30
MiB = 1 << 20


@dataclass(slots=True, eq=False)
class FakeEntry:
    entry_id: int
    kind: CheckpointKind
    saved_work: float
    share_bytes: float
    children: int = 0
    nbytes: int = 0
    tokens: tuple[int, ...] = ()
    last_access: float = 0.0
    uses: int = 0
    buffers: tuple = ()


def order(policy, *entries) -> list[int]:
    for e in entries:  # added least recent first
        policy.add(e)
    return [e.entry_id for e in policy.order()]


def test_protected_kinds_go_last_in_kind_then_lru_order():
    protected = sorted((k for k in K if k > K.LAST_MESSAGE), reverse=True)
    assert K.SYSTEM in protected  # and a client's cache breakpoint kind, when there is one
    got = order(
        ValueLRU(),
        *(FakeEntry(10 + i, k, 1.0, 1e9) for i, k in enumerate(protected)),  # worth little
        FakeEntry(0, K.PERIODIC, 1e12, 1.0),  # worth the most, still goes first
        FakeEntry(1, K.LAST_MESSAGE, 1e12, 1.0),
    )
    assert set(got[:2]) == {0, 1}
    assert got[2:] == [10 + i for i in reversed(range(len(protected)))]  # lower kind first


def test_less_work_per_byte_goes_first_at_equal_recency_weight():
    # Entries 0 and 1 are the least recent; 1 saves 1000x more per byte than 0.
    got = order(
        ValueLRU(),
        FakeEntry(0, K.HISTORY, 1.0, 1000.0),
        FakeEntry(1, K.HISTORY, 1000.0, 1.0),
        FakeEntry(2, K.HISTORY, 10.0, 10.0),
    )
    assert got[0] == 0 and got.index(1) > got.index(0)


def test_recency_wins_between_entries_of_similar_value():
    got = order(
        ValueLRU(),
        FakeEntry(0, K.HISTORY, 100.0, 10.0),
        FakeEntry(1, K.HISTORY, 120.0, 10.0),
        FakeEntry(2, K.HISTORY, 100.0, 10.0),
    )
    assert got == [0, 1, 2]
    policy = ValueLRU()
    entries = [FakeEntry(i, K.HISTORY, 100.0, 10.0) for i in range(3)]
    order(policy, *entries)
    policy.touch(entries[0])
    assert [e.entry_id for e in policy.order()] == [1, 2, 0]


def test_an_entry_passed_by_a_stored_extension_weighs_less():
    # Same work and bytes: the one with one stored child (a later checkpoint of the same
    # path serves every request that continues past it) goes first.
    got = order(
        ValueLRU(),
        FakeEntry(0, K.PERIODIC, 100.0, 10.0, children=0),
        FakeEntry(1, K.PERIODIC, 100.0, 10.0, children=1),
        FakeEntry(2, K.PERIODIC, 100.0, 10.0, children=2),  # a branch point
    )
    assert got[0] == 1


@pytest.mark.parametrize("work", [50.0, 0.0], ids=["saves work", "saves nothing"])
@pytest.mark.parametrize("policy", [KindLRU, ValueLRU])
def test_outlasting_agrees_with_the_order_for_a_new_entry(policy, work):
    p = policy()
    entries = [
        FakeEntry(
            i, list(K)[i % len(K)], float(10 ** (i % 4)) if i % 5 else 0.0, float(1 + i), i % 3
        )
        for i in range(14)
    ]
    order(p, *entries)
    new = Candidate(K.HISTORY, 10, work, 5.0)
    stays = p.outlasting(new)
    added = FakeEntry(99, new.kind, new.saved_work, new.share_bytes, new.children)
    p.add(added)
    ranked = [e.entry_id for e in p.order()]
    after = set(ranked[ranked.index(99) + 1 :])
    assert stays == after


def test_an_entry_that_saves_nothing_goes_first_and_leaves_the_scale_alone():
    got = order(
        ValueLRU(),
        FakeEntry(0, K.HISTORY, 1e4, 10.0),  # the oldest, 10^4 times as efficient as 1
        FakeEntry(1, K.HISTORY, 1.0, 10.0),
        FakeEntry(9, K.HISTORY, 0.0, 10.0),  # the newest; another entry serves all of it
    )
    # 9 first; and its zero work does not stretch the scale so far that efficiency stops
    # counting: the efficient old entry still outlasts the newer one.
    assert got == [9, 1, 0]


def test_the_store_ranks_by_work_from_the_longest_stored_prefix():
    store = PromptCache(10_000, policy=ValueLRU())
    store.set_prefill_cost("m", lambda a, b: float(b * b - a * a))

    @dataclass(frozen=True)
    class P:
        length: int
        nbytes: int = 10
        trimmable: bool = False

    tokens = list(range(100))
    store.insert("m", tokens[:40], P(40), K.PERIODIC)
    store.insert("m", tokens[:80], P(80), K.PERIODIC)
    store.insert("m", tokens[:60], P(60), K.PERIODIC)  # between: the parent of 80
    store.check_integrity()
    entries = {e.tokens: e for e in store._entries.values()}
    assert entries[tuple(tokens[:80])].saved_work == 80**2 - 60**2
    assert entries[tuple(tokens[:60])].saved_work == 60**2 - 40**2
    assert entries[tuple(tokens[:40])].children == 1
    store.set_budget(20)  # two go; removing one re-parents the ones after it
    store.check_integrity()


@dataclass(frozen=True)
class Doc:
    length: int
    trimmable: bool = True
    nbytes: int = 0

    def __post_init__(self):
        object.__setattr__(self, "nbytes", 10 * self.length)


def _docs_store(policy, budget: int) -> PromptCache:
    store = PromptCache(budget, policy=policy)
    store.set_prefill_cost("m", lambda a, b: float(b - a))
    return store


def test_a_trimmable_entry_is_covered_by_what_it_shares_with_another():
    # A dense model's second question on a document: trimming either entry serves the
    # document to the other, so each saves only its own question's tokens.
    store = _docs_store(ValueLRU(), 10**6)
    doc = tuple(range(1000))
    first, second = doc + (1, 2, 3), doc + (4, 5, 6, 7, 8)
    store.insert("m", first, Doc(len(first)), K.HISTORY)
    store.insert("m", second, Doc(len(second)), K.HISTORY)
    store.check_integrity()
    entries = {e.tokens: e for e in store._entries.values()}
    assert (entries[first].covered, entries[first].saved_work) == (1000, 3.0)
    assert (entries[second].covered, entries[second].saved_work) == (1000, 5.0)
    assert store.evict_entry("m", entries[second].entry_id).name == "EVICTED"
    assert (entries[first].covered, entries[first].saved_work) == (0, 1003.0)  # all its own
    store.check_integrity()


def test_an_exact_only_entry_is_not_covered_by_a_sibling():
    store = _docs_store(ValueLRU(), 10**6)
    doc = tuple(range(100))
    for tail in ((1,), (2,)):
        store.insert("m", doc + tail, Doc(101, trimmable=False), K.HISTORY)
    store.check_integrity()
    assert all(e.covered == 0 and e.saved_work == 101 for e in store._entries.values())


@pytest.mark.parametrize("policy", [KindLRU, ValueLRU])
def test_value_eviction_drops_the_covered_copy_not_another_document(policy):
    # Document B, then two questions on document A; room for two of the three. The kind
    # order drops the least recently used, B; value drops A's first question, which A's
    # second serves but for its question, so both documents stay and both hit.
    a, b = tuple(range(1000)), tuple(range(5000, 6000))
    store = _docs_store(policy(), 2 * 10 * 1010)
    for seq in (b + (1,), a + (1,), a + (2,)):
        store.insert("m", seq, Doc(len(seq)), K.HISTORY)
    store.check_integrity()
    align = lambda n: n // 100 * 100  # noqa: E731
    reuse = {
        name: store.match("m", doc + (9, 9), align).reuse_tokens
        for name, doc in (("a", a), ("b", b))
    }
    if policy is ValueLRU:
        assert reuse == {"a": 1000, "b": 1000}
    else:
        assert reuse == {"a": 1000, "b": 0}


# -- the simulation (tests/support/cache_sim.py) -------------------------------------------


@pytest.mark.parametrize(
    "model", [DENSE, HYBRID], ids=["dense Qwen3-8B-like", "hybrid Qwen3.5-27B-like"]
)
def test_value_eviction_saves_more_prefill_than_the_kind_order(model):
    requests = mixed_workload(seed=0, requests=240)
    budget = 4 * GiB  # about 3% (dense) / 10% (hybrid) of what the workload would store
    by_kind = simulate(model, requests, budget, KindLRU())
    by_value = simulate(model, requests, budget, ValueLRU())
    assert by_value.saved_work > 1.02 * by_kind.saved_work, (
        by_value.saved_share,
        by_kind.saved_share,
    )
    # The same requests, the same prompts: only the eviction order differs.
    assert by_value.prompt_work == by_kind.prompt_work and by_value.requests == 240


# -- the benchmark's mixed traffic, replayed (tests/support/trace_sim.py) -------------------

TRACED = [trace_sim.DENSE, trace_sim.HYBRID]


@pytest.mark.parametrize("model", TRACED, ids=lambda m: m.name)
def test_the_replay_reproduces_the_benchmark_run(model):
    trace = trace_sim.load(model.name)
    assert trace.budget_bytes == {"dense": 288, "hybrid": 56}[model.name] * MiB

    def cached(policy) -> list[int]:  # as that engine counted (a shared buffer twice)
        return trace_sim.replay(trace, model, trace.budget_bytes, policy, shared_once=False)

    assert cached(KindLRU()) == [r.cached["kind"] for r in trace.requests]
    # The value order as that run had it (alpha 1.5; the coverage changes nothing there).
    assert cached(ValueLRU(alpha=1.5)) == [r.cached["value"] for r in trace.requests]


@pytest.mark.parametrize(
    ("model", "budget_mib"),
    [(trace_sim.DENSE, b) for b in (224, 256, 288, 320, 384, 448)]
    + [(trace_sim.HYBRID, b) for b in (40, 48, 56, 64)],
    ids=lambda x: getattr(x, "name", f"{x}MiB"),
)
def test_value_eviction_restores_more_of_the_benchmarks_mixed_traffic(model, budget_mib):
    # 288 MiB is the dense benchmark's budget, 56 MiB the hybrid's. At 288 MiB a prefill's
    # end snapshot and its live cache (one buffer) counted twice left no room for the
    # other document: value equalled kind (see `shared_once=False`).
    trace = trace_sim.load(model.name)
    kind = sum(trace_sim.replay(trace, model, budget_mib * MiB, KindLRU()))
    value = sum(trace_sim.replay(trace, model, budget_mib * MiB, ValueLRU()))
    margin = f"{model.name} {budget_mib} MiB: value {value} / kind {kind} = {value / kind:.2f}x"
    print(margin)
    assert value >= 1.08 * kind, margin


@pytest.mark.parametrize("budget_mib", [192, 512])
def test_value_eviction_is_no_worse_at_the_dense_extremes(budget_mib):
    # 192 MiB keeps no second document beside the system prompts; 512 MiB keeps nearly
    # everything either way.
    trace = trace_sim.load("dense")
    kind = sum(trace_sim.replay(trace, trace_sim.DENSE, budget_mib * MiB, KindLRU()))
    value = sum(trace_sim.replay(trace, trace_sim.DENSE, budget_mib * MiB, ValueLRU()))
    print(f"dense {budget_mib} MiB: value {value} / kind {kind} = {value / kind:.2f}x")
    assert value >= kind
