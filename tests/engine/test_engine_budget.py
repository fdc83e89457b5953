"""A tight budget serves the conversation it holds (issue 55, item 3).

At 1.25x a conversation's final KV, every turn after the first restores its previous
turn whole and answers as a cold run does; the store never holds more than its budget
(stored + running requests' bytes, read from its stats after every change)."""

from __future__ import annotations

import pytest
from support.budget import cold_conversation, questions, watch_store
from support.engine_helpers import EXACT, cancelling, chat, collect, open_engine, run, wait_for
from support.models import TEST_CACHE, kv_of, loaded_test_model

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.records import CachePreference, PromptInput


def _turns(n: int, system_words: int) -> list[list[tuple[str, str]]]:
    messages, out = [("system", "You are a careful assistant. " * system_words)], []
    for i in range(n):
        messages.append(("user", f"Question {i}: " + "tell me about the topic please " * 30))
        out.append(list(messages))
        messages.append(("assistant", f"Answer {i}: " + "it is like this and that " * 20))
    return out


def _kv_per_token(model) -> int:
    # The dense test model: 2 layers x 2 KV heads x 16 dims x (keys, values) x float32.
    text = model.model.args
    layers, heads, dims = text.num_hidden_layers, text.num_key_value_heads, text.head_dim
    return layers * heads * dims * 2 * 4


# A conversation that grows turn by turn, and one whose long system prompt is most of it
# (its first turn's end alone takes most of the budget: it is stored from its decode row).
@pytest.mark.parametrize(("turns", "system_words"), [(5, 40), (3, 240)])
def test_a_conversation_keeps_hitting_at_a_budget_of_125_of_its_kv(
    monkeypatch, turns, system_words
):
    model = loaded_test_model("dense")
    turns = _turns(turns, system_words)
    config = EngineConfig(prefetch_next_turn=False)  # one request at a time, as measured
    with open_engine(model, TEST_CACHE, config) as cold_engine:
        cold = [run(cold_engine, chat(*m), cache=False, sampling=EXACT) for m in turns]
    final = cold[-1].usage.prompt_tokens
    budget = final * _kv_per_token(model) * 5 // 4
    _hits_every_turn(monkeypatch, model, config, budget, turns, cold)


def _hits_every_turn(monkeypatch, model, config, budget, turns, cold) -> None:
    """Each turn at `budget` restores its previous turn whole and answers as its cold run
    (tokens and logprobs); the store handed an entry over, and stored + running stayed
    within the budget at every store call."""
    watch = watch_store(monkeypatch)
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, config) as engine:
        previous = 0
        for messages, expected in zip(turns, cold, strict=True):
            warm = run(engine, chat(*messages), sampling=EXACT)
            assert warm.usage.cached_tokens >= previous  # its previous turn, whole
            assert warm.usage.cached_tokens < warm.usage.prompt_tokens
            assert (warm.tokens, warm.logprobs) == (expected.tokens, expected.logprobs)
            previous = warm.usage.prompt_tokens
        assert engine.views.cache_stats()["handed_over"] > 0  # the tight budget was the case
    watch.assert_capped(budget)


def test_a_cancelled_turn_loses_no_entry_the_store_handed_it():
    """The entry a tight budget hands to the turn that extends it comes back if that
    turn is cancelled mid-prefill: its prefill runs on and stores its end (left to its
    decode row otherwise, which a cancelled request never reaches), and the turn sent
    again restores it and answers as a cold run does."""
    model = loaded_test_model("dense")
    first, second = _turns(2, 40)
    config = EngineConfig(prefetch_next_turn=False, prefill_tokens_per_step=1)
    with open_engine(model, TEST_CACHE, config) as cold_engine:
        cold = run(cold_engine, chat(*second), cache=False, sampling=EXACT)
    budget = cold.usage.prompt_tokens * _kv_per_token(model) * 5 // 4
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, config) as engine:
        before = run(engine, chat(*first), sampling=EXACT).usage.prompt_tokens
        handle = engine.submit(chat(*second), EXACT, CachePreference())
        with cancelling(engine, before + 32) as landed:
            assert collect(handle).finish_reason == "cancelled"
        assert landed and engine.views.cache_stats()["handed_over"] > 0
        assert wait_for(lambda: not engine.loop.prefill.tasks)  # it ran on to its end
        again = run(engine, chat(*second), sampling=EXACT)
    # Its end came back (the handed-over turn before it too), as a resend finds it.
    assert again.usage.cached_tokens >= 0.95 * cold.usage.prompt_tokens > before
    assert (again.tokens, again.logprobs) == (cold.tokens, cold.logprobs)


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h", "sliding"])
def test_a_hybrid_conversation_keeps_hitting_at_a_budget_of_125_of_its_kv(monkeypatch, kind):
    """The same on a hybrid model (attention beside gated-delta recurrent layers) with a
    Qwen3-style template, the client sending back each reply it was given: the entry
    is handed over with its recurrent state, the end's KV comes back from the decode row
    and its recurrent state from where the prefill reached it (cache/handover.py)."""
    model = loaded_test_model(kind, think_template=True)
    config = EngineConfig(prefetch_next_turn=False)  # one request at a time, as measured
    turns, cold = cold_conversation(model, questions(4))
    budget = kv_of(model, cold[-1].usage.prompt_tokens) * 5 // 4
    _hits_every_turn(monkeypatch, model, config, budget, turns, cold)


@pytest.mark.parametrize("finish", [True, False], ids=["running-on", "stopped"])
@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h", "sliding"])
def test_a_cancelled_hybrid_turn_resumes_at_a_budget_of_125_of_its_kv(monkeypatch, kind, finish):
    """A hybrid conversation at 1.25x its KV whose third turn is cancelled part-way
    through its prefill, then sent again: the resend reuses what the cancelled prefill
    computed (the grid point it stopped at, or its end when it ran on) and answers as a
    cold run does; the budget holds at every store call. Reserving more than the live
    cache can still grow by (a whole step of KV padding on top of the rest of the
    prompt) made every checkpoint of the turn 'not fit': nothing was stored."""
    model = loaded_test_model(kind, think_template=True)
    turns, cold = cold_conversation(model, questions(3))
    budget = kv_of(model, cold[-1].usage.prompt_tokens) * 5 // 4
    watch = watch_store(monkeypatch)
    config = EngineConfig(
        prefetch_next_turn=False, prefill_tokens_per_step=1, finish_cancelled=finish
    )
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, config) as engine:
        for messages in turns[:2]:
            before = run(engine, chat(*messages), sampling=EXACT).usage.prompt_tokens
        last = cold[-1].usage.prompt_tokens
        handle = engine.submit(chat(*turns[2]), EXACT, CachePreference())
        with cancelling(engine, (before + last) // 2) as landed:
            assert collect(handle).finish_reason == "cancelled"
        (at,) = landed
        assert before < at < last
        assert wait_for(lambda: not engine.loop.prefill.tasks)
        computed = last if finish else at
        again = run(engine, chat(*turns[2]), sampling=EXACT)
    assert again.usage.cached_tokens >= 0.95 * computed, (again.usage.cached_tokens, computed)
    assert (again.tokens, again.logprobs) == (cold[-1].tokens, cold[-1].logprobs)
    watch.assert_capped(budget)


def _passage(i: int) -> PromptInput:
    """A long system passage (one of several alike, none a prefix of another) and a
    question: a prompt with checkpoints inside it, the last a few tokens before its end."""
    lines = " ".join(
        f"Passage {i} line {j}: the {('plum', 'fig', 'pear')[j % 3]} keeper said {j % 7} words."
        for j in range(60)
    )
    return chat(("system", lines), ("user", "In one sentence: who speaks first in this passage?"))


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h", "sliding"])
def test_a_cancelled_hybrid_prefill_running_on_stops_where_a_copied_state_does_not_fit(
    monkeypatch, kind
):
    """A hybrid prompt cancelled halfway at 1.1x its KV, another prompt's entries in the
    store: its prefill runs on to its last checkpoint before its end (what a resend of
    it restores: a hybrid resumes only at an exact state, never at its end), where the
    budget cannot hold a copy of its recurrent state beside the live cache; it stops
    there and stores the live cache itself (`PrefillTask.stop_at`). The resend restores
    exactly that point and answers as a cold run does; the budget holds at every store
    call. Running on to the end instead stored the end (which the resend cannot use)
    and no state at the last checkpoint: the resend restored an earlier one."""
    model = loaded_test_model(kind, think_template=True)
    config = EngineConfig(prefetch_next_turn=False, prefill_tokens_per_step=1)
    with open_engine(model, TEST_CACHE, config) as cold_engine:
        cold = run(cold_engine, _passage(1), cache=False, sampling=EXACT)
    n = cold.usage.prompt_tokens
    budget = kv_of(model, n) * 11 // 10
    watch = watch_store(monkeypatch)
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, config) as engine:
        run(engine, _passage(0), sampling=EXACT)
        plan = engine.plan(_passage(1))
        last = max(c.position for c in plan.checkpoints if c.position < n)
        handle = engine.submit(_passage(1), EXACT, CachePreference())
        with cancelling(engine, n // 2) as landed:
            assert collect(handle).finish_reason == "cancelled"
        (at,) = landed
        assert at < last
        assert wait_for(lambda: not engine.loop.prefill.tasks)
        stored: dict[int, CheckpointKind] = {}
        start = engine.loop.prefill.start

        def read_then_start(job):  # on the engine thread: the cancelled one has stored
            stored.update(
                (len(e.tokens), e.info.kind)
                for e in engine.store.sequences(engine.model_key)
                if e.tokens == plan.tokens[: len(e.tokens)]
            )
            return start(job)

        engine.loop.prefill.start = read_then_start
        warm = run(engine, _passage(1), sampling=EXACT)
    # The entry it stored ends at that checkpoint (nothing past it was computed).
    assert max(stored) == last and stored[last] is CheckpointKind.CANCELLED, stored
    assert warm.usage.cached_tokens == last
    assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)
    watch.assert_capped(budget)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_next_turn_keeps_its_entry_at_a_budget_that_holds_its_copy_beside_it(monkeypatch, kind):
    """The budget is the peak a conversation's two turns reach with nothing handed over
    (measured at a loose budget: the entry, the next turn's live copy of it as its
    buffers grow on the step grid, its end's piece), plus a chunk's KV. At that budget
    the next turn restores its previous turn beside the entry, not in its place: the
    entry stays for another branch, the reply equals a cold run's, and the cap holds at
    every store call. Reserving a whole step of KV past the prompt for the live copy
    handed the entry over (and freed it) for room the copy never takes."""
    model = loaded_test_model(kind, think_template=kind != "dense")
    system = ("system", "You are a careful assistant. " * 40)
    first = [system, ("user", "Question 0: " + "tell me about the topic please " * 30)]
    second = [*first, ("assistant", "Answer 0: it is like this."), ("user", "Why? " * 20)]
    config = EngineConfig(prefetch_next_turn=False)
    with open_engine(model, TEST_CACHE, config) as cold_engine:
        cold = run(cold_engine, chat(*second), cache=False, sampling=EXACT)
    watch = watch_store(monkeypatch)
    loose = CacheConfig(budget_bytes=1 << 30, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, loose, config) as engine:
        for messages in (first, second):
            run(engine, chat(*messages), sampling=EXACT)
        assert engine.views.cache_stats()["handed_over"] == 0
    chunk = kv_of(model, 64) - kv_of(model, 32)  # a chunk of KV (the other layers cancel)
    budget = max(watch.totals) + chunk
    watch.totals.clear()
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, config) as engine:
        before = run(engine, chat(*first), sampling=EXACT).usage.prompt_tokens
        warm = run(engine, chat(*second), sampling=EXACT)
        handed = engine.views.cache_stats()["handed_over"]
        stored = {len(e.tokens) for e in engine.store.sequences(engine.model_key)}
    assert warm.usage.cached_tokens == before  # its previous turn, whole
    assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)
    assert handed == 0 and before in stored, (handed, sorted(stored))
    watch.assert_capped(budget)
