"""The engine's read-only views for the dashboard: activity (waiting, prefilling,
decoding, warm-ups, prefetches), this model's sequences, pin and evict by entry id."""

from __future__ import annotations

from support.engine_helpers import chat, open_engine, prefill_held, run
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import wait_until

from mlx_prefix.cache.types import CheckpointKind, EvictOutcome
from mlx_prefix.config import EngineConfig
from mlx_prefix.records import PromptInput, SamplingParams, TokenEvent

PROMPT = chat(("system", "You are a terse assistant. " * 8), ("user", "Count to one hundred."))


def test_activity_shows_decoding_and_queued_requests_then_nothing():
    with open_engine(loaded_test_model("dense"), TEST_CACHE, EngineConfig(max_running=1)) as engine:
        first = engine.submit(PROMPT, SamplingParams(max_tokens=400), request_id="first")
        second = engine.submit(PROMPT, SamplingParams(max_tokens=3), request_id="second")
        events = first.events(timeout=60)
        while not isinstance(next(events), TokenEvent):
            pass

        def both_seen() -> bool:
            jobs = {j.request_id: j for j in engine.views.activity().jobs}
            return (
                jobs.keys() == {"first", "second"}
                and jobs["first"].state == "decoding"
                and jobs["first"].generated_tokens >= 1
                and jobs["second"].state == "queued"
            )

        assert wait_until(both_seen, timeout=30)
        activity = engine.views.activity()
        job = next(j for j in activity.jobs if j.request_id == "first")
        assert job.role == "request" and job.max_tokens == 400
        assert job.prompt_tokens == first.prompt_tokens
        assert job.cached_tokens + job.computed_tokens == job.prompt_tokens
        assert activity.capacity == 1
        first.cancel()
        assert list(second.events(timeout=60))[-1].finish_reason == "length"
        assert wait_until(lambda: engine.views.activity().jobs == (), timeout=30)


def test_a_warm_up_is_listed_as_one_while_it_prefills():
    with open_engine(loaded_test_model("dense"), TEST_CACHE, EngineConfig(max_running=1)) as engine:
        # A request decoding keeps the warm-up waiting long enough to be seen.
        busy = engine.submit(PROMPT, SamplingParams(max_tokens=400))
        events = busy.events(timeout=60)
        while not isinstance(next(events), TokenEvent):
            pass
        _, future = engine.start_warm(PromptInput(text="A prompt to warm. " * 20))
        assert wait_until(
            lambda: any(
                j.role == "warm" and j.state == "queued" for j in engine.views.activity().jobs
            ),
            timeout=30,
        )
        busy.cancel()
        assert future.result(60).prompt_tokens > 0
        assert wait_until(lambda: engine.views.activity().jobs == (), timeout=30)


def test_sequences_pin_and_evict_by_entry_id(make_engine):
    engine = make_engine("dense")
    run(engine, PROMPT)
    listed = engine.views.cache_sequences()
    assert listed and all(s.info.tokens == len(s.tokens) for s in listed)
    prompt_tokens = engine.plan(PROMPT).tokens
    assert all(tuple(prompt_tokens[: len(s.tokens)]) == s.tokens for s in listed)
    assert engine.views.disk_sequences() == []  # no disk tier here
    target = max(listed, key=lambda s: s.info.tokens)
    assert engine.views.set_pinned(target.info.entry_id, True)
    assert engine.views.evict_entry(target.info.entry_id) is EvictOutcome.PINNED
    assert engine.views.set_pinned(target.info.entry_id, False)
    assert engine.views.evict_entry(target.info.entry_id) is EvictOutcome.EVICTED
    assert target.info.entry_id not in {s.info.entry_id for s in engine.views.cache_sequences()}
    assert engine.views.evict_entry(target.info.entry_id) is EvictOutcome.MISSING
    assert not engine.views.set_pinned(target.info.entry_id, True)
    # what is left still serves, and the answer is still the cold run's
    warm = run(engine, PROMPT)
    cold = run(engine, PROMPT, cache=False)
    assert warm.text == cold.text
    engine.store.check_integrity()


def test_a_prefetch_is_listed_with_its_role():
    with open_engine(
        loaded_test_model("dense"), TEST_CACHE, EngineConfig(prefetch_delay_s=0.3)
    ) as engine:
        history = chat(
            ("system", "You are a terse assistant. " * 8),
            ("user", "Hello."),
            ("assistant", "Hi."),
            ("user", "Count to three."),
        )
        # The prefetch's first chunk waits until the test has seen it listed: a short one
        # could otherwise come and go between two looks, whatever the machine's speed.
        background = lambda: any(t.job.background for t in engine.loop.prefill.tasks)  # noqa: E731
        with prefill_held(engine, when=background):
            run(engine, history)
            seen = wait_until(
                lambda: any(j.role == "prefetch" for j in engine.views.activity().jobs)
            )
            assert seen, engine.views.activity()
        assert wait_until(lambda: engine.prefetch.completed == 1)
        assert wait_until(lambda: engine.views.activity().jobs == ())
        kinds = {s.info.kind for s in engine.views.cache_sequences()}
        assert CheckpointKind.HISTORY in kinds
