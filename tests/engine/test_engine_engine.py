"""Engine behaviour: cancellation, admission limits, isolation, the byte budget."""

from __future__ import annotations

import dataclasses
import time

import pytest
from mlx_lm.models.cache import KVCache
from support.engine_helpers import (
    PacedHandle,
    chat,
    open_engine,
    paced_submit,
    run,
    submit_together,
)
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.errors import ContextLengthExceeded, EngineBusy, InvalidRequest
from mlx_prefix.records import DoneEvent, PromptInput, SamplingParams, TokenEvent

PROMPT = chat(("system", "You are a terse assistant. " * 8), ("user", "Count to one hundred."))


def test_cancel_stops_the_request_and_frees_its_cache(make_engine):
    engine = make_engine("dense")
    engine.handle_type = PacedHandle  # the engine goes on only once token 2 cancelled it
    handle = paced_submit(engine, PROMPT, SamplingParams(max_tokens=500), after=2)
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
    assert engine.store.stats().active_bytes == 0  # freed before the DoneEvent went out
    assert run(engine, PROMPT).finish_reason == "length"  # the engine goes on serving
    engine.store.check_integrity()


def test_queue_limit_gives_a_busy_error():
    config = EngineConfig(max_running=1, max_queued=1)
    with open_engine(loaded_test_model("dense"), TEST_CACHE, config) as engine:
        running = engine.submit(PROMPT, SamplingParams(max_tokens=300))
        waiting = engine.submit(PROMPT, SamplingParams(max_tokens=300))
        with pytest.raises(EngineBusy):
            engine.submit(PROMPT, SamplingParams(max_tokens=5))
        for handle in (running, waiting):
            handle.cancel()
            assert list(handle.events(timeout=60))[-1].finish_reason == "cancelled"


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


class SpyStore(PromptCache):
    """Checks the budget each time the engine reports a running request's bytes."""

    def __init__(self, budget: int):
        super().__init__(budget)
        self.reported: dict[str, int] = {}  # key suffix -> largest bytes reported

    def set_active_bytes(self, request_id: str, nbytes: int, shared=()) -> None:
        super().set_active_bytes(request_id, nbytes, shared)
        suffix = request_id.rsplit("-", 1)[-1]
        self.reported[suffix] = max(self.reported.get(suffix, 0), nbytes)
        self.check_integrity()  # includes: over budget only if nothing is evictable


def test_byte_budget_holds_with_running_requests_counted():
    budget = 400_000
    store = SpyStore(budget)
    with open_engine(loaded_test_model("qwen3_5"), TEST_CACHE, store=store) as engine:
        for i in range(8):
            run(engine, chat(("system", f"Prompt {i}. " * 20), ("user", "Hello")))
        # Both a prefilling request's cache and the decode batch were counted...
        assert store.reported["prefill"] > 0 and store.reported["batch"] > 0
        # ...and forgotten once the requests ended.
        stats = store.stats()
        assert stats.active_bytes == 0 and stats.active_requests == 0
        assert stats.evictions > 0 and stats.bytes <= budget
        store.check_integrity()


class SharingSpy(PromptCache):
    """Records, when a reply's decode batch is first counted (its end stored, its
    prefill's cache now the batch's), the bytes counted and what the prefill last
    reported."""

    def __init__(self, budget: int):
        super().__init__(budget)
        self.prefill: tuple[int, tuple] = (0, ())  # last nbytes, shared buffers reported
        self.at_batch: list[tuple] = []  # (stats, prefill nbytes, batch nbytes, end payload)

    def set_active_bytes(self, request_id: str, nbytes: int, shared=()) -> None:
        super().set_active_bytes(request_id, nbytes, shared)
        if request_id.endswith("-prefill"):
            self.prefill = (nbytes, tuple(shared))
        elif request_id.endswith("-batch") and not self.at_batch:
            end = max(self.entries(), key=lambda e: e.tokens)
            [tokens] = [
                s.tokens for s in self.sequences(end.model_key) if s.info.entry_id == end.entry_id
            ]
            payload = self.get(end.model_key, tokens)
            self.at_batch.append((self.stats(), self.prefill[0], nbytes, payload))


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_stored_end_and_its_live_prefill_cache_count_once(kind):
    store = SharingSpy(1 << 30)
    with open_engine(loaded_test_model(kind), TEST_CACHE, store=store) as engine:
        run(engine, chat(("user", "Tell me about the sea. " * 12)))
    [(stats, prefill_bytes, batch_bytes, end_payload)] = store.at_batch
    # The end snapshot holds its own KV pieces, exactly as long as the prompt (cache/
    # chain.py), never the live cache's step-padded buffer: the live cache is the
    # request's (a lone request's decode batch adopts it: its bytes move to the batch,
    # issue 55), the pieces the entries' (a hybrid's checkpoints share them), each
    # counted once: stored bytes are the distinct buffers.
    assert 0 < end_payload.chain.nbytes < prefill_bytes
    assert all(b.nbytes != prefill_bytes for b in end_payload.buffers)
    assert stats.active_bytes == batch_bytes and stats.active_requests == 1
    store.check_integrity()


def test_prompt_longer_than_the_context_is_refused(make_engine):
    engine = make_engine("dense")
    engine.model = dataclasses.replace(engine.model, context_length=16)
    with pytest.raises(ContextLengthExceeded):
        engine.submit(PROMPT, SamplingParams())


def test_bad_input_is_refused_before_queueing(make_engine):
    engine = make_engine("dense")
    with pytest.raises(InvalidRequest):  # (a malformed message never gets this far)
        engine.submit(PromptInput(messages=()), SamplingParams())
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
    # The one client may pin the whole (tiny) budget here: the pin share is not the point.
    config = CacheConfig(
        budget_bytes=300_000, prefill_chunk=32, checkpoint_interval=64, pin_share=1.0
    )
    with open_engine(loaded_test_model("dense"), config) as engine:
        system = chat(("system", "Pinned instructions. " * 12))
        assert engine.warm(system, pin=True).pinned
        for i in range(6):
            run(engine, chat(("system", f"Other {i}. " * 30), ("user", "Hi")))
        user = chat(("system", "Pinned instructions. " * 12), ("user", "Go"))
        assert run(engine, user).usage.cached_tokens > 30
        engine.store.check_integrity()


def test_warm_pins_what_an_earlier_request_already_cached(make_engine):
    engine = make_engine("qwen3_5")
    system = chat(("system", "Pinned instructions. " * 12))
    run(engine, system)
    assert engine.store.stats().pinned == 0
    warmed = engine.warm(system, pin=True)
    assert warmed.cached_tokens > 0  # nothing new was computed or stored...
    assert warmed.pinned and engine.store.stats().pinned > 0  # ...yet the entries are pinned


def test_warm_reports_no_pin_when_nothing_could_be_stored():
    config = dataclasses.replace(TEST_CACHE, budget_bytes=1_000)  # smaller than any snapshot
    with open_engine(loaded_test_model("dense"), config) as engine:
        assert engine.warm(chat(("system", "Pinned instructions. " * 12)), pin=True).pinned is False
        assert engine.store.stats().pinned == 0


def test_dense_system_prompt_outlives_conversation_ends_under_pressure(make_engine):
    # An all-KV cache stores its system prompt as its own entry (kind SYSTEM), evicted
    # after every conversation's end (HISTORY), so it survives a crowd of other prompts.
    engine = make_engine("dense")
    system = "You are the assistant of a public library. Answer in one sentence. " * 3
    run(engine, chat(("system", system), ("user", "Do you open on Sundays?")))
    kinds = {e.kind.name: e.nbytes for e in engine.store.entries()}
    assert set(kinds) == {"SYSTEM", "HISTORY"}
    # Room for three conversation ends besides the system prompt, and for a running
    # request's step-padded caches (its prefill's and the decode batch's: entries hold
    # exactly their tokens, a live cache whole steps).
    history = next(e for e in engine.store.entries() if e.kind.name == "HISTORY")
    live = 2 * KVCache.step * history.nbytes // history.tokens
    engine.store.set_budget(kinds["SYSTEM"] + 3 * kinds["HISTORY"] + live)
    for i in range(12):
        run(engine, chat(("user", f"Unrelated question number {i} about the weather " * 6)))
    assert engine.store.stats().evictions > 0
    assert "SYSTEM" in {e.kind.name for e in engine.store.entries()}
    later = chat(("system", system), ("user", "Can I renew a loan online?"))
    system_end = max(c.position for c in engine.plan(later).checkpoints if c.kind.name == "SYSTEM")
    assert run(engine, later).usage.cached_tokens >= system_end
    engine.store.check_integrity()


def test_no_more_than_max_running_requests_decode_together():
    config = EngineConfig(max_running=2)
    with open_engine(loaded_test_model("dense"), TEST_CACHE, config) as engine:
        prompts = [chat(("user", f"Tell me about the number {i}.")) for i in range(5)]
        handles = submit_together(engine, prompts, SamplingParams(8))
        for handle in handles:
            assert list(handle.events(timeout=60))[-1].finish_reason in ("stop", "length")
        assert engine.loop.decode.peak_batch == 2


def test_seed_range_and_reply_fit_are_checked_before_queueing(make_engine):
    engine = make_engine("dense")
    with pytest.raises(InvalidRequest):
        engine.submit(PROMPT, SamplingParams(seed=-1))
    with pytest.raises(InvalidRequest):
        engine.submit(PROMPT, SamplingParams(seed=2**64))
    engine.model = engine.loop.model = dataclasses.replace(
        engine.model, context_length=len(engine.plan(PROMPT).tokens) + 4
    )
    with pytest.raises(ContextLengthExceeded):
        engine.submit(PROMPT, SamplingParams(max_tokens=5), fit_reply=True)
    assert engine.lifecycle.pending == 0
    # Without fit_reply the reply is cut at the context's end instead.
    result = run(engine, PROMPT, sampling=SamplingParams(max_tokens=50))
    assert result.usage.completion_tokens <= 4


def test_a_warm_up_that_times_out_is_cancelled(make_engine):
    engine = make_engine("dense")
    with pytest.raises(TimeoutError):
        engine.warm(chat(("system", "Warm me. " * 200)), timeout=0)
    deadline = time.monotonic() + 30
    while engine.lifecycle.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.lifecycle.pending == 0
    assert run(engine, PROMPT).finish_reason in ("stop", "length")  # still serving
