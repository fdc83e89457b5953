"""A cancelled prefill keeps what it computed (issue 55, engine/loop.py): it stores the
grid point it reached (a client's cancel, a warm-up's deadline, the shutdown), or runs on
to its prompt's end while nothing waits and gives way to a request that cannot use it.

Every test asserts the hit happened AND that the resend's answer is the cold run's, bit
for bit (greedy tokens and logprobs); every stored entry lies on the grid and holds what
a prefill of its tokens computes alone. Cancels land from inside the engine's prefill
step (between two chunks), so where they land never depends on the machine's speed."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from support.engine_helpers import (
    EXACT,
    alone_prefill,
    cache_states,
    cancelling,
    chat,
    collect,
    open_engine,
    prefill_held,
    run,
    wait_for,
)
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.snapshot import restore
from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import DiskConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.explain.explainer import Explainer
from mlx_prefix.records import CachePreference, DoneEvent, PromptInput, SamplingParams

K = CheckpointKind
# ~15-20 chunks of 32 tokens (TEST_CACHE's grid): a cancel lands well inside.
DOC = " ".join(
    f"Shelf {i} holds {i % 7} jars of {('plum', 'fig', 'pear')[i % 3]} jam." for i in range(48)
)
PROMPT = chat(("system", "You answer in one word."), ("user", DOC + " Which shelf is fullest?"))
OTHER = chat(("user", "Name three rivers in Europe, one per line."))


def _engine(kind: str, **config) -> Engine:
    config.setdefault("prefetch_next_turn", False)
    config.setdefault("prefill_tokens_per_step", 1)  # one chunk a step: cancels land on it
    return Engine(loaded_test_model(kind), TEST_CACHE, EngineConfig(**config))


def _unplanned_point(engine: Engine, prompt: PromptInput, near: int) -> int:
    """The first chunk end at or past `near` where the prompt's plan stores nothing: a
    cancel there stores a CANCELLED entry of its own."""
    plan = engine.plan(prompt)
    planned = {c.position for c in plan.checkpoints}
    ends = engine.planner.grid.chunk_ends(plan.tokens, 0)
    return next(p for p in ends if p >= near and p not in planned and p < len(plan.tokens))


def _kinds(engine: Engine, tokens: tuple[int, ...]) -> dict[int, K]:
    """Stored prefixes of `tokens`: length -> kind."""
    return {
        len(e.tokens): e.info.kind
        for e in engine.store.sequences(engine.model_key)
        if e.tokens == tokens[: len(e.tokens)]
    }


def _stored(engine: Engine) -> dict[int, K]:
    """Stored entries of the engine's model: length -> kind."""
    return {e.info.tokens: e.info.kind for e in engine.store.sequences(engine.model_key)}


def _all_exact(engine: Engine) -> None:
    """Every stored entry lies on the grid and holds what a prefill of its tokens
    computes alone, bit for bit."""
    for entry in engine.store.sequences(engine.model_key):
        assert engine.planner.grid.is_point(entry.tokens, len(entry.tokens)), "off the grid"
        got = cache_states(restore(engine.store.get(entry.info.model_key, entry.tokens)))
        want = alone_prefill(engine, entry.tokens)
        assert len(got) == len(want)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
    engine.store.check_integrity()


def _resend_is_cold(engine: Engine, prompt: PromptInput, computed: int):
    """The prompt sent again: it restores at least 95% of what was computed before, and
    answers as a cold run does, bit for bit."""
    warm = run(engine, prompt, sampling=EXACT)
    assert warm.usage.cached_tokens >= 0.95 * computed, (warm.usage.cached_tokens, computed)
    cold = run(engine, prompt, cache=False, sampling=EXACT)
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    return warm


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_cancelled_prefill_stores_the_grid_point_it_reached(kind):
    """--no-finish-cancelled: the state where the cancel landed is stored, CANCELLED, and
    nothing past it; the resend resumes there and the explainer names why."""
    engine = _engine(kind, finish_cancelled=False)
    try:
        n = len(engine.plan(PROMPT).tokens)
        point = _unplanned_point(engine, PROMPT, n // 2)
        with cancelling(engine, point) as landed:
            done = collect(engine.submit(PROMPT, SamplingParams(max_tokens=4)))
        assert done.finish_reason == "cancelled" and done.usage.completion_tokens == 0
        (at,) = landed
        assert at == point
        stored = _stored(engine)
        assert stored.get(at) is K.CANCELLED, stored
        assert max(stored) == at < n  # the last grid point it reached, nothing further
        assert done.usage.cache_written_tokens == at
        _all_exact(engine)
        handle = engine.submit(PROMPT, EXACT)
        warm = collect(handle)
        assert warm.usage.cached_tokens == at
        explainer = Explainer()
        assert handle.trace is not None
        explainer.submit(handle.trace, "resend", "chat", "ns")
        (record,) = explainer.records()
        explainer.close()
        assert record.reason == "cancelled", record
        assert f"resumed at token {at}" in record.detail
        cold = run(engine, PROMPT, cache=False, sampling=EXACT)
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_cancelled_prefill_runs_on_to_its_prompts_end_while_nothing_waits(kind):
    engine = _engine(kind)
    try:
        n = len(engine.plan(PROMPT).tokens)
        with cancelling(engine, n // 3):
            done = collect(engine.submit(PROMPT, SamplingParams(max_tokens=4)))
        assert done.finish_reason == "cancelled"  # the client hears it at once
        assert wait_for(lambda: not engine.loop.prefill.tasks)
        stored = _stored(engine)
        assert stored.get(n) is K.CANCELLED, stored  # the whole prompt, the first to go
        _all_exact(engine)
        # Esc, then the same prompt again: it finds the whole prompt.
        _resend_is_cold(engine, PROMPT, n)
        assert _stored(engine)[n] is K.HISTORY  # the resend's own store made it a real one
    finally:
        engine.shutdown()


def test_a_running_on_prefill_gives_way_to_a_request_that_cannot_use_it():
    """A request arrives while the cancelled prefill runs on: the prefill stops at its
    next grid point, stores it, and the request starts."""
    engine = _engine("qwen3_5")
    try:
        n = len(engine.plan(PROMPT).tokens)
        orphaned = lambda: any(t.job.orphaned for t in engine.loop.prefill.tasks)  # noqa: E731
        with cancelling(engine, n // 3) as landed, prefill_held(engine, orphaned):
            done = collect(engine.submit(PROMPT, SamplingParams(max_tokens=4)))
            other = engine.submit(OTHER, EXACT)  # arrives while the held step runs on
        assert done.finish_reason == "cancelled"
        answer = collect(other)
        (at,) = landed
        stored = {p: k for p, k in _stored(engine).items() if p > at}
        assert stored and max(stored) < n, stored  # stopped past the cancel, before the end
        assert all(k is K.CANCELLED for k in stored.values())
        cold = run(engine, OTHER, cache=False, sampling=EXACT)
        assert answer.tokens == cold.tokens and answer.logprobs == cold.logprobs
        _all_exact(engine)
        _resend_is_cold(engine, PROMPT, max(stored))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("finish", [True, False], ids=["running-on", "stopped"])
def test_the_shutdown_stores_where_a_prefill_stopped(finish):
    """The grace period over, a prefilling request is cancelled and stores where it
    stopped; a prefill running on for a cancelled request stops at the shutdown too."""
    engine = _engine("qwen3_5", finish_cancelled=finish)
    n = len(engine.plan(PROMPT).tokens)
    point = _unplanned_point(engine, PROMPT, n // 2)
    reached, go = threading.Event(), threading.Event()
    step, landed = engine.loop.prefill.step, []

    def hold_midway(*args, **kwargs):
        out = step(*args, **kwargs)
        task = engine.loop.prefill.tasks[0] if engine.loop.prefill.tasks else None
        if finish and task is not None and task.position >= n // 3:
            task.job.handle.cancel()  # it runs on, until the shutdown
        if task is not None and task.position >= point and not reached.is_set():
            if task.job.orphaned or not finish:
                landed.append(task.position)
                reached.set()
                go.wait(60)
        return out

    engine.loop.prefill.step = hold_midway
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=4))
    assert reached.wait(120)
    closer = threading.Thread(target=engine.shutdown, kwargs={"timeout": 0.0})
    closer.start()
    assert wait_for(lambda: engine.turns._stopping)
    go.set()
    closer.join(120)
    assert not closer.is_alive()
    assert collect(handle).finish_reason == "cancelled"
    (at,) = landed
    stored = _stored(engine)
    assert at == point and max(stored) == at and stored[at] is K.CANCELLED, stored
    _all_exact(engine)


def test_a_warm_up_past_its_deadline_stores_where_it_stopped():
    engine = _engine("dense", finish_cancelled=False)
    try:
        n = len(engine.plan(PROMPT).tokens)
        go, step, landed = threading.Event(), engine.loop.prefill.step, [0]

        def hold_midway(*args, **kwargs):
            out = step(*args, **kwargs)
            tasks = engine.loop.prefill.tasks
            if tasks:
                landed[0] = tasks[0].position
                if landed[0] >= n // 2:
                    go.wait(60)  # past the warm-up's deadline
            return out

        engine.loop.prefill.step = hold_midway
        with pytest.raises(TimeoutError):
            engine.warm(PROMPT, timeout=1.0)
        go.set()
        assert wait_for(lambda: engine.lifecycle.pending == 0)
        (at,) = landed
        stored = _stored(engine)
        assert max(stored) == at < n and stored[at] is K.CANCELLED, stored
        _all_exact(engine)
        engine.loop.prefill.step = step
        _resend_is_cold(engine, PROMPT, at)
    finally:
        engine.shutdown()


def test_a_cancel_inside_a_batched_prefill_stores_only_that_requests_point():
    """Three requests prefilling together, their chunks computed in the same steps; one
    is cancelled midway and stores its own grid point, the others go on."""
    engine = _engine("qwen3_5", finish_cancelled=False, prefill_tokens_per_step=96)
    try:
        prompts = [
            chat(("system", f"Reader {i}."), ("user", DOC + f" Which shelf, reader {i}?"))
            for i in range(3)
        ]
        victim = prompts[1]
        n = len(engine.plan(victim).tokens)
        point = _unplanned_point(engine, victim, n // 2)
        with cancelling(engine, point, lambda s: s == victim) as landed:
            with prefill_held(engine):
                handles = [engine.submit(p, SamplingParams(max_tokens=3)) for p in prompts]
            results = [collect(h) for h in handles]
        assert engine.loop.prefill.peak_tasks == 3
        assert [r.finish_reason for r in results][1] == "cancelled"
        assert all(r.usage.completion_tokens == 3 for r in (results[0], results[2]))
        assert landed == [point]  # the schedule depends on tokens alone: it lands there
        kinds = _kinds(engine, engine.plan(victim).tokens)
        assert max(kinds) == point and kinds[point] is K.CANCELLED, kinds  # nothing past it
        _all_exact(engine)
        _resend_is_cold(engine, victim, point)
    finally:
        engine.shutdown()


INSTRUCTION = "Summarize each snippet in one line. " + " ".join(
    ("harbor", "meadow", "copper", "ledger", "quarry")[i % 5] for i in range(120)
)


def test_a_cancel_in_a_stacking_burst_computes_its_rest_alone_on_the_grid():
    """A burst whose rests stack: the one cancelled before its rest ran leaves the stack
    and runs on alone, on the grid, storing its end; nothing of the stacked forward is
    stored."""
    engine = _engine("dense", prefill_tokens_per_step=256)
    try:
        prime = chat(("system", INSTRUCTION), ("user", "Snippet: the first one."))
        collect(engine.submit(prime, SamplingParams(max_tokens=2)))
        prompts = [chat(("system", INSTRUCTION), ("user", f"Snippet: lamp {w} river."))
                   for w in ("harbor", "meadow", "copper", "ledger")]  # fmt: skip
        victim = prompts[2]
        start = engine.loop.prefill.start

        def start_then_cancel(job):
            started = start(job)
            if job.source == victim:
                job.handle.cancel()  # after its restore, before its rest is computed
            return started

        engine.loop.prefill.start = start_then_cancel
        with prefill_held(engine):
            handles = [engine.submit(p, SamplingParams(max_tokens=2)) for p in prompts]
        results = [collect(h) for h in handles]
        engine.loop.prefill.start = start
        assert results[2].finish_reason == "cancelled"
        assert engine.loop.prefill.tails_stacked >= 2, "no rests were stacked"
        assert wait_for(lambda: not engine.loop.prefill.tasks)
        tokens = engine.plan(victim).tokens
        n = len(tokens)
        assert _kinds(engine, tokens).get(n) is K.CANCELLED
        _all_exact(engine)
        _resend_is_cold(engine, victim, n)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_the_same_prompt_sent_again_waits_for_the_prefill_running_on(kind):
    """Esc, then the same prompt at once: the resend does not preempt the cancelled
    prefill (it restores from it), and finds the whole prompt."""
    engine = _engine(kind)
    try:
        n = len(engine.plan(PROMPT).tokens)
        orphaned = lambda: any(t.job.orphaned for t in engine.loop.prefill.tasks)  # noqa: E731
        with cancelling(engine, n // 3) as landed, prefill_held(engine, orphaned):
            done = collect(engine.submit(PROMPT, SamplingParams(max_tokens=4)))
            resend = engine.submit(PROMPT, EXACT)  # arrives while the held step runs on
        assert done.finish_reason == "cancelled" and len(landed) == 1
        warm = collect(resend)
        assert warm.usage.cached_tokens >= 0.95 * n, (warm.usage.cached_tokens, n)
        cold = run(engine, PROMPT, cache=False, sampling=EXACT)
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
        _all_exact(engine)
    finally:
        engine.shutdown()


def test_a_cancelled_image_prompt_resumes_past_its_image():
    """A Qwen3.5 vision prompt (M-RoPE, recurrent layers) cancelled after its image: the
    grid point it reached is stored and the resend answers as a cold run does."""
    from support.vision_models import SYSTEM, image, loaded, prompt, user

    model = loaded("qwen3_5")
    config = EngineConfig(prefetch_next_turn=False, prefill_tokens_per_step=1,
                          finish_cancelled=False)  # fmt: skip
    engine = Engine(model, TEST_CACHE, config)
    try:
        target = prompt(SYSTEM, user("Here is my screen:", image(1), DOC + " What is wrong?"))
        plan = engine.plan(target)
        span = plan.vision.spans[0]
        point = _unplanned_point(engine, target, max(span.end + 1, len(plan.tokens) // 2))
        with cancelling(engine, point) as landed:
            done = collect(engine.submit(target, SamplingParams(max_tokens=4)))
        assert done.finish_reason == "cancelled" and landed == [point]
        assert _kinds(engine, plan.tokens).get(point) is K.CANCELLED
        warm = collect(engine.submit(target, EXACT))
        assert warm.usage.cached_tokens == point
        cold = collect(engine.submit(target, EXACT, CachePreference(enabled=False)))
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    finally:
        engine.shutdown()


def test_a_prefill_stopped_where_the_disk_wanted_more_is_saved_for_a_restart(tmp_path):
    """`--disk-cache full` chose the prompt's checkpoints (past where it stopped): the
    point it reached is queued for disk too, so a restart resumes there."""
    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    config = EngineConfig(prefetch_next_turn=False, prefill_tokens_per_step=1,
                          finish_cancelled=False)  # fmt: skip
    with open_engine(loaded_test_model("dense"), TEST_CACHE, config, disk_config=disk) as first:
        n = len(first.plan(PROMPT).tokens)
        point = _unplanned_point(first, PROMPT, n // 2)
        with cancelling(first, point) as landed:
            done = collect(first.submit(PROMPT, SamplingParams(max_tokens=4)))
        assert done.finish_reason == "cancelled" and landed == [point]
    with open_engine(loaded_test_model("dense"), TEST_CACHE, config, disk_config=disk) as second:
        warm = run(second, PROMPT, sampling=EXACT)
        assert warm.usage.cached_tokens == point
        assert second.views.cache_stats()["disk"]["hits"] == 1
        cold = run(second, PROMPT, cache=False, sampling=EXACT)
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs


def test_a_request_asking_for_progress_hears_nothing_after_its_cancel():
    """Its prefill runs on, but its final event was the last it gets (issue 55 item 5's
    progress events stop there)."""
    engine = _engine("dense")
    try:
        n = len(engine.plan(PROMPT).tokens)
        with cancelling(engine, n // 3):
            handle = engine.submit(PROMPT, SamplingParams(max_tokens=4), progress=True)
            events = list(handle.events(timeout=120))
        assert wait_for(lambda: not engine.loop.prefill.tasks)  # ran on to the end
        assert _stored(engine).get(n) is K.CANCELLED
        assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "cancelled"
        assert handle._queue.empty(), "an event after the final one"
    finally:
        engine.shutdown()
