"""A next-turn prefetch under a tight budget (issue 55, item 3): the budget stays a cap.

A prefetch (engine/requests/prefetch.py) computes a conversation's next turn while the
client reads the reply. At 1.25x the conversation's KV it must not hold its own copy of
the stored entry beside that entry (two copies of one KV: over the budget, and its end
then refused for room): the store's stored + running bytes stay within the budget at
every store call while it runs, and the next turn still restores the whole previous
prompt and answers as a cold run does."""

from __future__ import annotations

import pytest
from support.budget import SYSTEM, cold_conversation, questions, watch_store
from support.engine_helpers import EXACT, cancelling, chat, open_engine, run, wait_for
from support.models import TEST_CACHE, kv_of, loaded_test_model

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.keys import entry_key
from mlx_prefix.records import CachePreference, SamplingParams


def _count_prefetches(engine: Engine) -> tuple[list[int], list[int]]:
    """(decided, enqueued): requests whose reply the engine decided on (a prefetch or
    not, on the engine thread after the request's last event), and prefetches queued."""
    decided: list[int] = []
    enqueued: list[int] = []
    on_reply, enqueue = engine.loop.decode._on_reply, engine.prefetcher.enqueue

    def deciding(job, reply):
        on_reply(job, reply)
        decided.append(1)

    def queuing(*args, **kwargs):
        enqueued.append(1)
        return enqueue(*args, **kwargs)

    engine.loop.decode._on_reply, engine.prefetcher.enqueue = deciding, queuing
    return decided, enqueued


def _wait_prefetched(engine: Engine, decided: list[int], enqueued: list[int], turns: int) -> None:
    """Wait until the `turns`-th reply was decided on and its prefetch, if any, ended."""
    assert wait_for(lambda: len(decided) >= turns)
    engine.prefetcher._pool.submit(lambda: None).result(timeout=60)  # its render ran
    stats = engine.prefetch
    done = lambda: stats.completed + stats.cancelled + stats.no_room  # noqa: E731
    assert wait_for(lambda: done() >= len(enqueued) and not engine.loop.prefill.tasks)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_prefetch_keeps_the_budget_a_cap_and_the_next_turn_hits(monkeypatch, kind):
    model = loaded_test_model(kind, think_template=True)
    # Four long questions, then a short one: the prefetch after the last may not fit.
    turns, cold = cold_conversation(model, [*questions(4), "Thanks, one more word on it?"])
    budget = kv_of(model, cold[-1].usage.prompt_tokens) * 5 // 4
    watch = watch_store(monkeypatch)
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, EngineConfig(prefetch_delay_s=0.0)) as engine:
        decided, enqueued = _count_prefetches(engine)
        previous = 0
        for n, (messages, expected) in enumerate(zip(turns, cold, strict=True), start=1):
            warm = run(engine, chat(*messages), sampling=EXACT)
            assert warm.usage.cached_tokens >= previous, f"turn {n}"  # its previous turn
            assert warm.usage.cached_tokens < warm.usage.prompt_tokens
            assert (warm.tokens, warm.logprobs) == (expected.tokens, expected.logprobs)
            previous = warm.usage.prompt_tokens
            _wait_prefetched(engine, decided, enqueued, n)
        assert engine.prefetch.started > 0  # the case: prefetches ran
        # The last turn's entry outlived the prefetch after it: its next turn hits too.
        last = engine.plan(chat(*turns[-1])).tokens
        stored = engine.store.sequences(engine.model_key)
        assert any(tuple(s.tokens[: len(last)]) == tuple(last) for s in stored)
        engine.store.check_integrity()
    watch.assert_capped(budget)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_prefetch_that_gives_way_keeps_the_entry_it_was_handed(kind):
    """A prefetch handed its conversation's entry and stopped between two chunks (a
    request it must give way to, or a cancel) stores its cache at the grid point it
    reached in that entry's place: the next turn restores past the previous prompt, and
    answers as a cold run does."""
    model = loaded_test_model(kind, think_template=True)
    long = SamplingParams(max_tokens=96, temperature=0.0, logprobs=True)
    turns, cold = cold_conversation(model, questions(3), sampling=long)
    assert len(cold[1].tokens) > 64  # a reply of several chunks: the prefetch stops inside
    budget = kv_of(model, cold[-1].usage.prompt_tokens) * 5 // 4
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    one_chunk = EngineConfig(prefetch_delay_s=0.0, prefill_tokens_per_step=1)
    with open_engine(model, cache, one_chunk) as engine:
        decided, enqueued = _count_prefetches(engine)
        run(engine, chat(*turns[0]), sampling=long)
        _wait_prefetched(engine, decided, enqueued, 1)
        second = run(engine, chat(*turns[1]), sampling=long)
        previous, completed = second.usage.prompt_tokens, engine.prefetch.completed
        with cancelling(engine, previous + 32, which=lambda source: source is None) as landed:
            assert wait_for(lambda: len(decided) >= 2)
            engine.prefetcher._pool.submit(lambda: None).result(timeout=60)  # its render ran
            assert wait_for(lambda: bool(landed) and not engine.loop.prefill.tasks)
        assert engine.prefetch.completed == completed  # it stopped inside its prompt
        third = run(engine, chat(*turns[2]), sampling=long)
        engine.store.check_integrity()
    assert third.usage.cached_tokens >= landed[0] > previous
    assert (third.tokens, third.logprobs) == (cold[2].tokens, cold[2].logprobs)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_next_turn_that_leaves_the_prefetched_reply_still_restores_the_previous_prompt(
    kind,
):
    """The prefetch was handed the stored turn and stored its end in its place; the
    client then sends another reply back (an edit): the turn still restores the previous
    prompt (a hybrid's state there came back inside the prefetch's end) and answers as a
    cold run does."""
    model = loaded_test_model(kind, think_template=True)
    users = questions(5)
    turns, messages = [], [SYSTEM]
    with open_engine(model, TEST_CACHE, EngineConfig(prefetch_next_turn=False)) as cold_engine:
        for user in users[:-1]:
            messages.append(("user", user))
            turns.append(list(messages))
            reply = run(cold_engine, chat(*messages), cache=False, sampling=EXACT)
            messages.append(("assistant", reply.text))
        edited = [*turns[-1], ("assistant", "An edited reply."), ("user", users[-1])]
        cold = run(cold_engine, chat(*edited), cache=False, sampling=EXACT)
    budget = kv_of(model, cold.usage.prompt_tokens) * 5 // 4
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, EngineConfig(prefetch_delay_s=0.0)) as engine:
        decided, enqueued = _count_prefetches(engine)
        for n, turn in enumerate(turns, start=1):
            previous = run(engine, chat(*turn), sampling=EXACT).usage.prompt_tokens
            handed, completed = engine.views.cache_stats()["handed_over"], engine.prefetch.completed
            _wait_prefetched(engine, decided, enqueued, n)
        # The last prefetch ran, handed the stored turn (the case).
        assert engine.prefetch.completed > completed
        assert engine.views.cache_stats()["handed_over"] > handed
        warm = run(engine, chat(*edited), sampling=EXACT)
        engine.store.check_integrity()
    # Its prompt leaves the stored sequence just past the previous prompt (the grid
    # point before the divergence: at most a chunk before it).
    assert warm.usage.cached_tokens >= previous - 32
    assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_prefetch_the_budget_cannot_hold_stops_before_it_goes_past(monkeypatch, kind):
    """A prefetch with nothing to restore (its conversation's entry is gone) whose prompt
    the budget cannot hold gives way before the chunk that would take the store past its
    budget: the cap holds while it runs."""
    model = loaded_test_model(kind, think_template=True)
    prompt = chat(SYSTEM, ("user", "Question: " + "tell me about the topic please " * 60))
    watch = watch_store(monkeypatch)
    with open_engine(model, TEST_CACHE, EngineConfig(prefetch_next_turn=False)) as sizing:
        rendered = sizing.plan(prompt)
    budget = kv_of(model, len(rendered.tokens)) // 2
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, EngineConfig(prefetch_delay_s=0.0)) as engine:
        engine._enqueue_prefetch(rendered, entry_key(engine.model_key, CachePreference()))
        stats = engine.prefetch
        ended = lambda: stats.completed + stats.no_room == 1  # noqa: E731
        assert wait_for(lambda: ended() and not engine.loop.prefill.tasks)
        engine.store.check_integrity()
    watch.assert_capped(budget)
    assert stats.no_room == 1 and stats.completed == 0  # it stopped inside its prompt
