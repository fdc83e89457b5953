"""What one prefill stores (engine/prefill/checkpoints.py): checkpoints that share the prefill's
attention KV as one chain of pieces (cache/chain.py), counted once in the byte budget, and
the branch point.

Memory is measured with MLX's own allocator counter (`mx.get_active_memory`): what the
store counts must be what is resident once the request's cache is gone.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from support.engine_helpers import chat, run, warm_equals_cold
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.snapshot import capture
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.forward.runner import prefill, prefill_steps
from mlx_prefix.engine.keys import entry_key
from mlx_prefix.engine.prefill.checkpoints import Checkpointer
from mlx_prefix.prompt.request.grid import ChunkGrid
from mlx_prefix.prompt.request.plan import Checkpoint, RenderedPrompt
from mlx_prefix.records import CachePreference, PromptInput

HYBRIDS = ["qwen3_5", "nemotron_h", "sliding"]
N, EVERY, CHUNK = 2048, 256, 128


def _prompt() -> RenderedPrompt:
    tokens = tuple(100 + (i * 7919) % 20000 for i in range(N))
    checkpoints = tuple(Checkpoint(p, CheckpointKind.PERIODIC) for p in range(EVERY, N, EVERY))
    return RenderedPrompt(tokens, (*checkpoints, Checkpoint(N, CheckpointKind.HISTORY)), False)


def _prefill_into(store: PromptCache, kind: str, shared: bool) -> list:
    """Prefill the prompt, storing a checkpoint every EVERY tokens; returns the state
    layers' sizes (bytes of each non-KV layer at the end)."""
    model = loaded_test_model(kind).model
    prompt = _prompt()
    cache = make_prompt_cache(model)
    if shared:
        checkpointer = Checkpointer(prompt, cache, 0, store, "m", None)
        prefill(model, cache, prompt.tokens, 0, ChunkGrid(CHUNK), checkpointer)
        checkpointer.finish()
    else:  # what the Checkpointer did before: every checkpoint a whole capture

        def checkpointer(p: int) -> None:
            if p % EVERY == 0:
                store.insert("m", prompt.tokens[:p], capture(cache, p), CheckpointKind.PERIODIC)

        prefill(model, cache, prompt.tokens, 0, ChunkGrid(CHUNK), checkpointer)
    kv = sum(c.nbytes for c in cache if type(c) is KVCache)
    state = sum(c.nbytes for c in cache if type(c) is not KVCache)
    return [kv, state]


def _resident(kind: str, shared: bool) -> tuple[int, int, PromptCache, list]:
    """(bytes resident, bytes counted by the store, the store, [kv, state] sizes)."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    store = PromptCache(1 << 34)
    sizes = _prefill_into(store, kind, shared)
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory() - base, store.stats().bytes, store, sizes


@pytest.mark.parametrize("kind", HYBRIDS)
def test_a_prefills_checkpoints_share_its_kv_and_the_budget_counts_it_once(kind):
    _resident(kind, True)  # warm-up: lazily built model constants stay allocated
    resident, counted, store, (kv, state) = _resident(kind, True)
    store.check_integrity()
    entries = store.entries()
    assert len(entries) == N // EVERY
    # Bytes counted are bytes resident (a few KB of MLX's own small arrays aside).
    assert abs(resident - counted) <= 32 << 10, (resident, counted)
    # All checkpoints hold one chain of KV pieces: each adds its own piece and its
    # recurrent / rotating state; each holds exactly its prefix's KV (no step padding).
    assert counted == kv + len(entries) * state
    assert all(e.nbytes == state + kv * e.tokens // N for e in entries)
    last = max(entries, key=lambda e: e.tokens)
    assert all(e.shared_bytes == kv * e.tokens // N for e in entries if e is not last)

    before, before_counted, _, _ = _resident(kind, False)
    assert abs(before - before_counted) <= 32 << 10
    # Before: each checkpoint pinned its own copy of the prefix KV (quadratic growth).
    assert before > 2 * resident


@pytest.mark.parametrize("kind", ["qwen3_5", "sliding"])
def test_evicting_one_checkpoint_frees_its_state_and_the_last_frees_the_kv(kind):
    _, counted, store, (kv, state) = _resident(kind, True)
    entries = store.entries()
    store.set_budget(counted - 1)  # one entry must go: only its own state is freed
    assert store.stats().bytes == counted - state
    assert store.stats().entries == len(entries) - 1
    store.set_budget(kv + state)  # down to one checkpoint: the KV buffer stays for it
    assert store.stats().entries == 1 and store.stats().bytes == kv + state
    store.set_budget(0)
    assert store.stats().bytes == 0 and store.stats().entries == 0
    store.check_integrity()


@pytest.mark.parametrize("kind", ["qwen3_5", "sliding"])
def test_a_cancelled_prefill_keeps_the_checkpoints_it_reached(make_engine, kind):
    engine = make_engine(kind, cache_config=CacheConfig(prefill_chunk=32, checkpoint_interval=64))
    prompt = PromptInput(text=" ".join(f"item {i} is on shelf {i % 7}." for i in range(60)))
    plan = engine.plan(prompt)
    n = len(plan.tokens)
    cache = make_prompt_cache(engine.model.model)
    checkpointer = Checkpointer(
        plan, cache, 0, engine.store, entry_key(engine.model_key, CachePreference()), None
    )
    steps = prefill_steps(
        engine.model.model, cache, plan.tokens, 0, engine.planner.grid, checkpointer
    )
    for end in steps:
        if end >= n // 2:
            break
    steps.close()  # cancelled between two chunks
    checkpointer.finish()
    stored = max(e.tokens for e in engine.store.entries())
    assert 64 <= stored <= end < n
    result = warm_equals_cold(engine, prompt)
    assert result.usage.cached_tokens == stored


def test_a_failed_prefill_stores_nothing_it_had_deferred(make_engine):
    engine = make_engine("qwen3_5")
    prompt = engine.plan(PromptInput(text="one two three four five six seven eight " * 20))
    cache = make_prompt_cache(engine.model.model)
    checkpointer = Checkpointer(
        prompt, cache, 0, engine.store, entry_key(engine.model_key, CachePreference()), None
    )
    prefill(engine.model.model, cache, prompt.tokens, 0, engine.planner.grid, checkpointer)
    checkpointer.finish(keep=False)
    assert engine.store.stats().entries == 0


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_branch_point_checkpoint_serves_both_shapes(make_engine, kind):
    # A long interval: no periodic checkpoint lies near the divergence.
    engine = make_engine(kind, cache_config=CacheConfig(prefill_chunk=32, checkpoint_interval=4096))
    words = [f"verse {i}: and the river ran past the mill." for i in range(40)]
    a = PromptInput(text=" ".join(words))
    b = PromptInput(text=" ".join(words[:30] + ["a new verse is written here."]))
    c = PromptInput(text=" ".join(words[:30] + ["yet another ending.", *words[31:]]))
    run(engine, a)
    ta, tb = engine.plan(a).tokens, engine.plan(b).tokens
    diverge = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    point = engine.planner.grid.align(tb, diverge)
    assert point > 2 * 32
    first = warm_equals_cold(engine, b)
    assert first.usage.cached_tokens < point  # nothing stored near the branch yet
    # `b` left `a`'s path at `point`: its prefill checkpointed there, so a third prompt
    # sharing that prefix (either shape's next request) restores from it.
    third = warm_equals_cold(engine, c)
    assert third.usage.cached_tokens == point


def test_pending_states_beyond_the_budget_are_thinned_evenly():
    model = loaded_test_model("qwen3_5").model
    prompt = _prompt()  # a checkpoint every 256 tokens: 7 periodic and the end
    probe = PromptCache(1 << 34)
    kv, state = _prefill_into(probe, "qwen3_5", True)
    store = PromptCache(kv + 5 * state)  # room for the cache and 4 pending states
    cache = make_prompt_cache(model)
    checkpointer = Checkpointer(prompt, cache, 0, store, "m", None)
    prefill(model, cache, prompt.tokens, 0, ChunkGrid(CHUNK), checkpointer)
    assert checkpointer.pending_bytes <= 4 * state
    checkpointer.finish()
    kept = sorted(e.tokens for e in store.entries())
    # Every other periodic checkpoint went (not the last ones): 512, 1024, 1536 and the
    # end, which is not periodic and never thinned.
    assert kept == [2 * EVERY, 4 * EVERY, 6 * EVERY, N]
    store.check_integrity()


def _distinct_tokens(sequences: list[tuple[int, ...]]) -> int:
    """Tokens of the union of `sequences` as a trie (each shared prefix once)."""
    root: dict = {}
    count = 0
    for tokens in sequences:
        node = root
        for t in tokens:
            if t not in node:
                node[t] = {}
                count += 1
            node = node[t]
    return count


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_conversations_turns_hold_each_token_once_and_keep_the_turn_before(make_engine, kind):
    # Issue 48: turn N+1's entry holds only what it adds to turn N's (its chain shares
    # the pieces), so the store holds each distinct token's KV once plus each entry's
    # fixed-size state, and a regenerate of the turn before still restores that turn.
    engine = make_engine(kind)
    messages = [("system", "You sort library cards. " + "shelf " * 40)]
    prompts = []
    for turn in range(3):
        messages.append(("user", f"Card {turn}: " + "river lamp " * (10 + 7 * turn)))
        prompts.append(chat(*messages))
        result = warm_equals_cold(engine, prompts[-1])
        if turn:
            assert result.usage.cached_tokens >= len(engine.plan(prompts[-2]).tokens) - 1
        messages.append(("assistant", result.text))
    stored = engine.store.sequences(engine.model_key)
    assert len(stored) >= 3
    snapshots = [engine.store.get(s.info.model_key, s.tokens) for s in stored]
    longest = max(snapshots, key=lambda s: s.length)
    kv_per_token = longest.chain.nbytes // longest.length
    states = sum(s.nbytes - s.chain.nbytes for s in snapshots)
    distinct = _distinct_tokens([s.tokens for s in stored])
    assert engine.store.stats().bytes == distinct * kv_per_token + states
    engine.store.check_integrity()
    # Regenerating the turn before restores up to its own end, bit for bit as a miss.
    before = engine.plan(prompts[1]).tokens
    again = warm_equals_cold(engine, prompts[1])
    assert again.usage.cached_tokens >= len(before) - TEST_CACHE.prefill_chunk
