"""Engine behaviour: cancellation, admission limits, isolation, the byte budget."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TEST_CACHE, loaded_test_model
from engine_helpers import chat, run

from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.request import DoneEvent, SamplingParams, TokenEvent
from mlx_prefix.errors import ContextLengthExceeded, EngineBusy, InvalidRequest

PROMPT = chat(("system", "You are a terse assistant. " * 8), ("user", "Count to one hundred."))


def test_cancel_stops_the_request_and_frees_its_cache(make_engine):
    engine = make_engine("dense")
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=500))
    tokens = 0
    for event in handle.events(timeout=60):
        if isinstance(event, TokenEvent):
            tokens += 1
            if tokens == 2:
                handle.cancel()
        if isinstance(event, DoneEvent):
            done = event
    assert done.finish_reason == "cancelled"
    assert tokens < 50
    assert run(engine, PROMPT).finish_reason == "length"  # the engine goes on serving
    assert engine.store.stats().active_bytes == 0
    engine.store.check_integrity()


def test_queue_limit_gives_a_busy_error():
    config = EngineConfig(max_running=1, max_queued=1)
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, config)
    try:
        running = engine.submit(PROMPT, SamplingParams(max_tokens=300))
        waiting = engine.submit(PROMPT, SamplingParams(max_tokens=300))
        with pytest.raises(EngineBusy):
            engine.submit(PROMPT, SamplingParams(max_tokens=5))
        for handle in (running, waiting):
            handle.cancel()
            assert list(handle.events(timeout=60))[-1].finish_reason == "cancelled"
    finally:
        engine.shutdown()


def test_another_model_never_hits_the_first_models_entries():
    store = PromptCache(1 << 30)
    dense, hybrid = loaded_test_model("dense"), loaded_test_model("qwen3_5")
    a, b = Engine(dense, TEST_CACHE, store=store), Engine(hybrid, TEST_CACHE, store=store)
    try:
        run(a, PROMPT)
        assert run(a, PROMPT).usage.cached_tokens > 0
        assert run(b, PROMPT).usage.cached_tokens == 0
        assert run(b, PROMPT).usage.cached_tokens > 0
        store.check_integrity()
    finally:
        a.shutdown()
        b.shutdown()


def test_byte_budget_holds_with_running_requests_counted():
    budget = 400_000
    config = dataclasses.replace(TEST_CACHE, budget_bytes=budget)
    engine = Engine(loaded_test_model("qwen3_5"), config)
    try:
        for i in range(8):
            run(engine, chat(("system", f"Prompt {i}. " * 20), ("user", "Hello")))
            stats = engine.store.stats()
            assert stats.bytes + stats.active_bytes <= budget or stats.entries == 0
            engine.store.check_integrity()
        assert engine.store.stats().evictions > 0
    finally:
        engine.shutdown()


def test_prompt_longer_than_the_context_is_refused(make_engine):
    engine = make_engine("dense")
    engine.model = dataclasses.replace(engine.model, context_length=16)
    with pytest.raises(ContextLengthExceeded):
        engine.submit(PROMPT, SamplingParams())


def test_bad_input_is_refused_before_queueing(make_engine):
    engine = make_engine("dense")
    with pytest.raises(InvalidRequest):
        engine.submit(chat(("wizard", "hi")), SamplingParams())
    with pytest.raises(InvalidRequest):
        engine.submit(PROMPT, SamplingParams(max_tokens=0))


def test_stop_string_ends_generation_without_reaching_the_text(make_engine):
    engine = make_engine("dense")
    free = run(engine, PROMPT, sampling=SamplingParams(max_tokens=12))
    stop = free.text[3:6]
    assert stop.strip()
    stopped = run(engine, PROMPT, sampling=SamplingParams(max_tokens=12, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)


def test_warm_then_pin_survives_eviction_pressure():
    config = CacheConfig(budget_bytes=300_000, prefill_chunk=32, checkpoint_interval=64)
    engine = Engine(loaded_test_model("dense"), config)
    try:
        system = chat(("system", "Pinned instructions. " * 12))
        engine.warm(system, pin=True)
        for i in range(6):
            run(engine, chat(("system", f"Other {i}. " * 30), ("user", "Hi")))
        user = chat(("system", "Pinned instructions. " * 12), ("user", "Go"))
        assert run(engine, user).usage.cached_tokens > 30
        engine.store.check_integrity()
    finally:
        engine.shutdown()
