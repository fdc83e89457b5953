"""The default mode (no --deterministic): decode batches every running row in one forward,
as mlx_lm.server does, and the cache stays exact by construction. Every state the cache
stores is what a prefill of those tokens computes alone on the canonical grid, also when
it was computed while other requests decoded, and no decode-computed state is ever
stored or served; so a hit computes exactly what a miss computes, on any backend,
without measuring anything."""

from __future__ import annotations

import mlx.core as mx
import pytest
from support.engine_helpers import (
    PacedHandle,
    alone_prefill,
    cache_states,
    chat,
    collect,
    open_engine,
    paced_submit,
    run,
    submit_together,
    warm_equals_cold,
)
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.snapshot import restore
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine import calibration, loop
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.records import CachePreference, SamplingParams, TokenEvent

INSTRUCTION = "Answer in one line and keep every name. " + " ".join(
    ("harbor", "meadow", "copper", "ledger", "quarry")[i % 5] for i in range(90)
)
QUESTIONS = [f"Question {i}: " + "lamp river " * (2 + 3 * i) for i in range(4)]


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "nemotron_h", "sliding"])
def test_every_stored_state_is_the_alone_prefill_even_computed_beside_decoding(kind):
    with open_engine(
        loaded_test_model(kind), TEST_CACHE, EngineConfig(prefetch_next_turn=False)
    ) as engine:
        # Two long replies decode while a burst sharing an instruction prefills beside them:
        # the engine waits after the second reply's first token until the burst is in, so
        # it arrives while both decode (the burst's prefill takes fewer steps than the
        # replies' 40 tokens), whatever the speed of this thread.
        engine.handle_type = PacedHandle
        early = [
            paced_submit(
                engine,
                chat(("user", f"Tell a long story number {i}.")),
                SamplingParams(40),
                after=i or None,
            )
            for i in range(2)
        ]
        events = early[1].events(timeout=120)  # held here: dropped, it would cancel
        first = next(e for e in events if isinstance(e, TokenEvent))
        assert first.token is not None
        prompts = [chat(("system", INSTRUCTION), ("user", q)) for q in QUESTIONS]
        late = [engine.submit(p, SamplingParams(max_tokens=6)) for p in prompts]
        early[1].release()
        late_results = [collect(h) for h in late]
        still_running = engine.loop.decode.peak_batch
        for h in early:
            assert collect(h).finish_reason == "length"  # decoded beside the burst, whole
        assert still_running >= 3, "the burst never decoded beside the long replies"
        assert any(r.usage.cached_tokens > 0 for r in late_results)  # in-flight sharing hit

        submitted = [engine.plan(p).tokens for p in prompts] + [
            engine.plan(chat(("user", f"Tell a long story number {i}."))).tokens for i in range(2)
        ]
        stored = engine.store.sequences(engine.model_key)
        # The instruction's end and the long replies' prompts at least (a burst's short
        # rests may compute stacked, and then store nothing: test_engine_stacked_tails.py).
        assert len(stored) >= 2
        for entry in stored:
            tokens = entry.tokens
            # Only prompt prefixes: a reply's tokens (decode's state) are never stored.
            assert any(tuple(p[: len(tokens)]) == tokens for p in submitted), entry.info
            got = cache_states(restore(engine.store.get(entry.info.model_key, tokens)))
            want = alone_prefill(engine, tokens)
            assert len(got) == len(want)
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True)), (
                f"the entry at {len(tokens)} tokens is not the alone prefill's"
            )
        engine.store.check_integrity()


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "sliding"])
def test_a_hit_answers_as_a_miss_after_batched_traffic(make_engine, kind):
    engine = make_engine(kind)
    prompts = [chat(("system", INSTRUCTION), ("user", q)) for q in QUESTIONS]
    handles = submit_together(engine, prompts, SamplingParams(max_tokens=8))
    for h in handles:
        collect(h)
    assert engine.loop.decode.peak_batch >= 2  # the traffic that filled the cache was batched
    for prompt in prompts:
        warm = warm_equals_cold(engine, prompt)
        assert warm.usage.cached_tokens > len(engine.plan(prompt).tokens) // 2  # a real hit


def test_the_default_mode_measures_nothing_and_decodes_in_one_plain_forward(
    make_engine, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("the default mode calibrated")

    monkeypatch.setattr(loop, "calibrate", refuse)
    engine = make_engine("dense")
    prompts = [chat(("user", f"Count to {i + 3}.")) for i in range(4)]
    handles = submit_together(engine, prompts, SamplingParams(max_tokens=6))
    for h in handles:
        collect(h)
    assert engine.loop.decode.peak_batch >= 2 and engine.loop.capacity == engine.config.max_running
    assert engine.loop.decode.batch.rows is None  # no row groups: one forward for every row
    assert not engine.loop.prefill.group  # prefill chunks computed alone


def test_deterministic_mode_calibrates_before_its_first_request(make_engine, monkeypatch):
    seen = []
    real = calibration.calibrate

    def counting(model, agreement=None):
        seen.append(model)
        return real(model, agreement)

    monkeypatch.setattr(loop, "calibrate", counting)
    engine = make_engine("dense", deterministic=True)
    run(engine, chat(("user", "Hello")), cache=False)
    assert len(seen) == 1
    assert engine.loop.decode.batch.rows is not None and engine.loop.decode.batch.rows >= 1


def test_requests_prefill_fewest_tokens_left_first():
    """Without stacking, each step takes the chunks of the request closest to its first
    token first: a short prompt arriving behind a long one is not held behind all of
    its chunks (one 256-token chunk a step here, so the order decides)."""
    cache = CacheConfig(budget_bytes=1 << 30, prefill_chunk=256)
    config = EngineConfig(gather_tokens=0, prefill_tokens_per_step=256)
    with open_engine(loaded_test_model("dense"), cache, config) as engine:
        off, sampling = CachePreference(enabled=False), SamplingParams(max_tokens=2)
        firsts: list[str] = []  # request ids in the order the engine sent a first token

        class Recording(RequestHandle):
            def emit(self, event):
                if isinstance(event, TokenEvent) and self.request_id not in firsts:
                    firsts.append(self.request_id)
                super().emit(event)

        engine.handle_type = Recording
        # Submitted together: the long prompt's first chunk waits until the short is in.
        long, short = submit_together(
            engine, [chat(("user", "word " * 900)), chat(("user", "Hi"))], sampling, [off, off]
        )
        for handle in (short, long):
            collect(handle)
        assert engine.loop.prefill.peak_tasks == 2  # they prefilled side by side
        assert firsts == [short.request_id, long.request_id]
