"""Stacked tails (engine/prefill/tails.py): requests ready together with a short rest of
prompt left compute their rests in one forward, and nothing of them is stored; each
computes alone up to its last checkpoint before its end and stores that (issue 55).

What is guaranteed, on any backend: a stacked rest computes the same function as the
rest alone (equal up to float rounding: the batched matmuls may round differently, as a
decode step's do), every stored state is still the alone prefill's bit for bit, a rest
that owes a checkpoint to others computes alone, and --deterministic never stacks."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.engine_helpers import (
    EXACT,
    alone_prefill,
    cache_states,
    chat,
    collect,
    submit_together,
    warm_equals_cold,
)
from support.models import loaded_test_model

from mlx_prefix.cache.snapshot import capture, restore
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.forward.runner import ChunkWork, compute_tails
from mlx_prefix.engine.keys import entry_key
from mlx_prefix.engine.prefill.tails import (
    CPU_PADDING,
    GPU_PADDING,
    closest_rests,
    padding_allowance,
    stacking,
)
from mlx_prefix.records import CachePreference, SamplingParams

INSTRUCTION = "Summarize each snippet in one line. " + " ".join(
    ("harbor", "meadow", "copper", "ledger", "quarry")[i % 5] for i in range(120)
)


def _close(a: mx.array, b: mx.array) -> bool:
    return mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=1e-3, atol=1e-3).item()


def _offsets(cache: list) -> list[int]:
    return [c.offset for c in cache if isinstance(getattr(c, "offset", None), int)]


def _history(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return cache


@pytest.mark.parametrize(
    ("kind", "rests"),
    [("dense", (3, 9, 6)), ("qwen3_5", (5, 5, 5)), ("nemotron_h", (4, 4, 4))],
)
def test_a_stacked_rest_computes_what_it_computes_alone(kind, rests):
    """Histories of different lengths, rests right-padded where the cache allows it
    (dense) and of one length otherwise: each row's last logits and cache equal the
    alone computation's up to rounding, and a decode step after them does too. A wrong
    position, mask or padding would be off by far more."""
    model = loaded_test_model(kind).model
    histories = [[7 + i for i in range(n)] for n in (11, 4, 17)]
    tails = [[40 + 3 * j + i for i in range(n)] for j, n in enumerate(rests)]
    alone_logits, alone_caches, works = [], [], []
    for history, tail in zip(histories, tails, strict=True):
        base = _history(model, history)
        snapshot = capture(base, len(history))
        alone = restore(snapshot)
        alone_logits.append(model(mx.array(tail)[None], cache=alone)[:, -1, :])
        alone_caches.append(alone)
        tokens = history + tail
        works.append(ChunkWork(restore(snapshot), tokens, len(history), len(tokens)))
    padded = len(set(rests)) > 1
    stacked_logits = compute_tails(model, works, padded)
    for w, got, want, alone in zip(works, stacked_logits, alone_logits, alone_caches, strict=True):
        assert got.shape == want.shape
        assert _close(got, want)
        assert _offsets(w.cache) == _offsets(alone)
        got_states, want_states = cache_states(w.cache), cache_states(alone)
        assert len(got_states) == len(want_states)
        assert all(_close(a, b) for a, b in zip(got_states, want_states, strict=True))
        step = mx.array([[5]])
        assert _close(model(step, cache=w.cache)[:, -1, :], model(step, cache=alone)[:, -1, :])


def test_sliding_window_caches_never_stack():
    model = loaded_test_model("sliding").model
    cache = make_prompt_cache(model)

    class Task:  # what `stacking` reads
        pass

    task = Task()
    task.cache = cache
    assert stacking(task) == 0


class _Rest:  # what `closest_rests` reads of a task
    def __init__(self, rest: int):
        self.tokens, self.position = [0] * (100 + rest), 100


def _lengths(group) -> list[int]:
    return sorted(len(t.tokens) - t.position for t in group)


def test_rests_stack_only_as_far_as_their_padding_allows():
    """On the CPU a forward costs in proportion to its tokens, padding included, so only
    rests of about one length stack; on a GPU, rests up to twice their tokens padded.
    Within that, the most rests stack, and the fewest padded tokens on ties."""
    assert padding_allowance(mx.cpu) == CPU_PADDING < padding_allowance(mx.gpu) == GPU_PADDING
    burst = [_Rest(n) for n in (114, 53, 93, 210, 81, 58)]  # a warm burst's snippets
    assert _lengths(closest_rests(burst, CPU_PADDING, 10**6)) == [53, 58]
    assert _lengths(closest_rests(burst, GPU_PADDING, 10**6)) == [53, 58, 81, 93, 114]
    questions = [_Rest(n) for n in (22, 23, 22, 24, 23, 22, 40, 41)]
    assert _lengths(closest_rests(questions, CPU_PADDING, 10**6)) == [22, 22, 22, 23, 23, 24]
    # Within a step's budget of prompt tokens while others decode (two at least).
    assert _lengths(closest_rests(questions, CPU_PADDING, 70)) == [22, 22, 22]
    assert _lengths(closest_rests(questions, CPU_PADDING, 10)) == [22, 22]


def _burst(engine: Engine, prompts: list, max_tokens: int) -> list:
    """Serve `prompts` arriving together (engine_helpers.submit_together)."""
    handles = submit_together(engine, prompts, SamplingParams(max_tokens=max_tokens))
    return [collect(h) for h in handles]


def _engine(kind: str, **config) -> Engine:
    config.setdefault("prefetch_next_turn", False)
    cache = CacheConfig(budget_bytes=1 << 30)
    return Engine(loaded_test_model(kind), cache, EngineConfig(**config))


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_warm_burst_stacks_its_rests_and_stores_only_alone_prefills(kind):
    engine = _engine(kind)
    try:
        prime = chat(("system", INSTRUCTION), ("user", "Snippet: the first one."))
        collect(engine.submit(prime, SamplingParams(max_tokens=2)))
        # Snippets of one token length, so the hybrid's equal-rest groups meet too.
        prompts = [chat(("system", INSTRUCTION), ("user", f"Snippet: lamp {w} river."))
                   for w in ("harbor", "meadow", "copper", "ledger")]  # fmt: skip
        assert len({len(engine.plan(p).tokens) for p in prompts}) == 1
        stored_before = {e.tokens for e in engine.store.sequences(engine.model_key)}
        results = _burst(engine, prompts, max_tokens=4)
        assert engine.loop.prefill.tails_stacked >= 2, "no rests were stacked"
        assert all(r.usage.cached_tokens > 0 for r in results)  # the instruction was a hit
        assert all(r.usage.completion_tokens == 4 for r in results)
        stored = engine.store.sequences(engine.model_key)
        for entry in stored:
            got = cache_states(restore(engine.store.get(entry.info.model_key, entry.tokens)))
            want = alone_prefill(engine, entry.tokens)
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
        # A stacked rest stores nothing: each request stored at most its last checkpoint
        # before its end (computed alone, where its stack began), and only those that
        # computed alone to the end stored it.
        new = {e.tokens for e in stored if e.tokens not in stored_before}
        ends = 0
        for plan in (engine.plan(p) for p in prompts):
            n = len(plan.tokens)
            last = max(c.position for c in plan.checkpoints if c.position < n)
            mine = [len(e) for e in new if tuple(plan.tokens[: len(e)]) == e]
            assert set(mine) <= {last, n}
            ends += n in mine
        assert ends <= len(prompts) - engine.loop.prefill.tails_stacked
        engine.store.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_stacked_turns_store_their_last_checkpoint_and_the_next_turn_restores_there(kind):
    """Several conversations' turns arriving together (issue 55 item 6): each computes
    alone on the grid up to its last planned checkpoint before its end and stores it;
    only the rest after it stacks. Each next turn (this prompt, the reply, a new message)
    then restores at least that far, and answers as a cold run does, bit for bit."""
    engine = _engine(kind)
    try:
        prime = chat(("system", INSTRUCTION), ("user", "Snippet: the first one."))
        collect(engine.submit(prime, SamplingParams(max_tokens=2)))
        words = ("harbor", "meadow", "copper", "ledger")
        histories = [
            (
                ("system", INSTRUCTION),
                ("user", f"Snippet: lamp {w} river."),
                ("assistant", "Noted."),
            )
            for w in words
        ]
        questions = [("user", f"Next: stone {w} field.") for w in words]
        prompts = [chat(*h, q) for h, q in zip(histories, questions, strict=True)]
        assert len({len(engine.plan(p).tokens) for p in prompts}) == 1
        handles = submit_together(engine, prompts, EXACT)
        results = [collect(h) for h in handles]
        assert engine.loop.prefill.tails_stacked >= 2, "no rests were stacked"
        grid = engine.planner.grid
        for entry in engine.store.sequences(engine.model_key):  # exact, on the grid
            assert grid.is_point(entry.tokens, len(entry.tokens))
            got = cache_states(restore(engine.store.get(entry.info.model_key, entry.tokens)))
            want = alone_prefill(engine, entry.tokens)
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
        for history, prompt, result, w in zip(histories, prompts, results, words, strict=True):
            plan = engine.plan(prompt)
            last = max(c.position for c in plan.checkpoints if c.position < len(plan.tokens))
            # stored at its stack point, or at its end where it computed alone
            key = entry_key(engine.model_key, CachePreference())
            ends = (plan.tokens[:last], plan.tokens)
            assert any(engine.store.get(key, e) is not None for e in ends)
            turn = chat(
                *history,
                ("user", f"Next: stone {w} field."),
                ("assistant", result.text),
                ("user", "And then?"),
            )
            assert tuple(engine.plan(turn).tokens[:last]) == tuple(plan.tokens[:last])
            warm = warm_equals_cold(engine, turn)
            assert warm.usage.cached_tokens >= last
        engine.store.check_integrity()
    finally:
        engine.shutdown()


def test_a_rest_that_owes_the_system_prompt_computes_alone_and_stores_it():
    """A cold burst: the system prompt's checkpoint lies in every rest, so none stacks
    until it is stored; the next burst finds it."""
    engine = _engine("qwen3_5", gather_tokens=0)
    try:
        prompts = [chat(("system", INSTRUCTION), ("user", f"Snippet {i}.")) for i in range(3)]
        for h in [engine.submit(p, SamplingParams(max_tokens=2)) for p in prompts]:
            collect(h)
        later = collect(engine.submit(chat(("system", INSTRUCTION), ("user", "Snippet 9.")),
                                      SamplingParams(max_tokens=2)))  # fmt: skip
        assert later.usage.cached_tokens >= len(INSTRUCTION.split())  # the system prompt
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "config", [{"deterministic": True}, {"stack_tail_tokens": 0}], ids=["deterministic", "off"]
)
def test_deterministic_mode_or_stack_tails_0_never_stacks_rests(config):
    engine = _engine("dense", **config)
    try:
        prime = chat(("system", INSTRUCTION), ("user", "Snippet: the first one."))
        collect(engine.submit(prime, SamplingParams(max_tokens=2)))
        prompts = [chat(("system", INSTRUCTION), ("user", f"Snippet {i}.")) for i in range(4)]
        _burst(engine, prompts, max_tokens=2)
        assert engine.loop.prefill.tails_stacked == 0
    finally:
        engine.shutdown()
