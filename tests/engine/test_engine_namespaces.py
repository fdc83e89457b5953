"""Cache namespaces in the engine (issue 19, invariant 10): a request matches only entries
of its own namespace (and cache_salt), in memory, in flight, in prefetches and on disk;
inside a namespace a hit still answers exactly like a cold run."""

from __future__ import annotations

import dataclasses
import time

import pytest
from support.engine_helpers import (
    EXACT,
    GREEDY,
    Result,
    chat,
    collect,
    open_engine,
    prefill_held,
    run,
    submit_together,
    wait_for,
)
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.types import CheckpointKind
from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.conversation import Message
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.keys import entry_key, namespace_id, namespace_key, namespace_of
from mlx_prefix.engine.requests.scheduler import extends
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    PromptInput,
    TokenEvent,
)

A = CachePreference(namespace="origin=chrome-extension://aaaa")
B = CachePreference(namespace="origin=chrome-extension://bbbb")
SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4
PROMPT = chat(("system", SYSTEM), ("user", "Where are the atlases?"))


def ask(engine: Engine, prompt: PromptInput, pref: CachePreference, sampling=EXACT) -> Result:
    handle = engine.submit(prompt, sampling, pref)
    text, tokens, logprobs = [], [], []
    for event in handle.events(timeout=120):
        if isinstance(event, TokenEvent):
            text.append(event.text)
            tokens += [event.token] if event.token is not None else []
            logprobs += [event.logprob] if event.logprob is not None else []
        elif isinstance(event, ErrorEvent):
            raise AssertionError(event.message)
        elif isinstance(event, DoneEvent):
            return Result("".join(text), tokens, event.usage, event.finish_reason, logprobs)
    raise AssertionError("no DoneEvent")


def same_answer(a: Result, b: Result) -> bool:
    return a.tokens == b.tokens and a.logprobs == b.logprobs


def test_keys_hold_the_namespace_as_a_digest():
    a, salted = entry_key("m", A), entry_key("m", dataclasses.replace(A, salt="s"))
    assert a == namespace_key("m", A.namespace) and salted.startswith(a + "/")
    assert namespace_of(a) == namespace_of(salted) == namespace_id(A.namespace)
    assert entry_key("m", B) != a and namespace_of("m") is None
    assert "chrome-extension" not in a + salted  # the Origin never shows in a key


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_two_namespaces_both_miss_then_each_hits_only_its_own(make_engine, kind):
    engine = make_engine(kind)
    cold = ask(engine, PROMPT, CachePreference(enabled=False))
    first_a, first_b = ask(engine, PROMPT, A), ask(engine, PROMPT, B)
    assert first_a.usage.cached_tokens == 0
    assert first_b.usage.cached_tokens == 0, "B matched what A cached"
    again_a, again_b = ask(engine, PROMPT, A), ask(engine, PROMPT, B)
    assert again_a.usage.cached_tokens > 40 and again_b.usage.cached_tokens > 40
    # The library's default namespace ("") is a third one: it saw neither.
    assert ask(engine, PROMPT, CachePreference()).usage.cached_tokens == 0
    for result in (first_a, first_b, again_a, again_b):
        assert same_answer(result, cold), "a namespace changed the answer"
    keys = {s.info.model_key for s in engine.views.cache_sequences()}
    assert {namespace_of(k) for k in keys} == {namespace_id(n) for n in ("", *_names(A, B))}
    engine.store.check_integrity()


def _names(*prefs: CachePreference) -> list[str]:
    return [p.namespace for p in prefs]


def test_cache_salt_splits_one_namespace(make_engine):
    engine = make_engine("dense")
    s1, s2 = dataclasses.replace(A, salt="alice"), dataclasses.replace(A, salt="bob")
    assert ask(engine, PROMPT, s1).usage.cached_tokens == 0
    assert ask(engine, PROMPT, s2).usage.cached_tokens == 0
    assert ask(engine, PROMPT, A).usage.cached_tokens == 0  # no salt: apart from both
    warm = ask(engine, PROMPT, s1)
    assert warm.usage.cached_tokens > 40
    assert same_answer(warm, ask(engine, PROMPT, CachePreference(enabled=False)))
    # A flush of the namespace takes every salt in it, and nothing of another namespace.
    ask(engine, PROMPT, B)
    assert engine.views.flush_cache(A.namespace) >= 3
    assert {namespace_of(s.info.model_key) for s in engine.views.cache_sequences()} == {
        namespace_id(B.namespace)
    }


INSTRUCTION = (
    "Translate the following text into plain, friendly English. Keep names unchanged, "
    "keep the paragraph structure, do not add commentary, and if a sentence is ambiguous "
    "choose the most common reading. The text follows after the colon: "
)


@pytest.mark.parametrize("kind", ["qwen3_5", "dense"])
def test_in_flight_sharing_stays_inside_a_namespace(make_engine, kind):
    # Only in-flight sharing (or an end-of-prompt snapshot) could serve the instruction.
    # Batch-invariant: each answer is compared with its alone run's below.
    cache = CacheConfig(prefill_chunk=32, checkpoint_interval=4096)
    engine = make_engine(kind, cache_config=cache, deterministic=True)
    texts = [f"Texte numero {i}: le train de {7 + i} heures part du quai {i}." for i in range(4)]
    prompts = [chat(("user", INSTRUCTION + t)) for t in texts]
    handles = submit_together(engine, prompts, GREEDY, [A, B, A, B])
    usages, answers = [], []
    for handle in handles:
        tokens = []
        for event in handle.events(timeout=120):
            if isinstance(event, TokenEvent) and event.token is not None:
                tokens.append(event.token)
            elif isinstance(event, DoneEvent):
                usages.append(event.usage)
        answers.append(tokens)
    first = engine.plan(prompts[0]).tokens
    shared = engine.planner.grid.align(
        first, common_prefix_length(first, engine.plan(prompts[2]).tokens)
    )
    assert shared >= 2 * 32
    assert usages[0].cached_tokens == 0
    assert usages[1].cached_tokens == 0, "B restored A's in-flight prefix"
    assert usages[2].cached_tokens >= shared and usages[3].cached_tokens >= shared
    for tokens, prompt in zip(answers, prompts, strict=True):
        assert tokens == run(engine, prompt, cache=False).tokens
    engine.store.check_integrity()


def test_a_next_turn_prefetch_serves_only_its_own_namespace():
    with open_engine(
        loaded_test_model("dense"), TEST_CACHE, EngineConfig(prefetch_delay_s=0.0)
    ) as engine:
        history = chat(("system", SYSTEM), ("user", "Hi."), ("assistant", "Hello!"))
        history = PromptInput(messages=(*history.messages, Message("user", "Go on.")))
        reply = ask(engine, history, A, sampling=GREEDY)
        deadline = time.monotonic() + 60
        while engine.prefetch.completed < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.prefetch.completed == 1
        assert engine.prefetch.tokens > 0  # it computed the reply again, for A
        nxt = PromptInput(
            messages=(
                *history.messages,
                Message("assistant", reply.text),
                Message("user", "And then?"),
            )
        )
        computed = len(engine.plan(history).tokens)
        from_b = ask(engine, nxt, B)
        assert from_b.usage.cached_tokens == 0, "B restored A's prefetch"
        from_a = ask(engine, nxt, A)
        assert from_a.usage.cached_tokens > computed  # the prefetch reached past the reply
        assert same_answer(from_a, ask(engine, nxt, CachePreference(enabled=False)))


def test_a_pinned_warm_up_pins_only_its_namespace(make_engine):
    engine = make_engine("dense")
    result = engine.warm(PROMPT, pin=True, cache=A)
    assert result.pinned and result.cached_tokens == 0
    assert engine.warm(PROMPT, cache=B).cached_tokens == 0  # A's warm-up is not B's
    mine = namespace_id(A.namespace)
    pinned = {
        namespace_of(s.info.model_key) for s in engine.views.cache_sequences() if s.info.pinned
    }
    assert pinned == {mine}
    assert ask(engine, PROMPT, A).usage.cached_tokens > 40


def disk_engine(tmp_path, prefetch: bool = True) -> Engine:
    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    config = EngineConfig(prefetch_next_turn=prefetch)
    return Engine(loaded_test_model("dense"), TEST_CACHE, config, disk_config=disk)


def test_disk_entries_keep_their_namespace_across_a_restart(tmp_path):
    first = disk_engine(tmp_path)
    try:
        cold = ask(first, PROMPT, CachePreference(enabled=False))
        ask(first, PROMPT, A)
    finally:
        first.shutdown()
    assert list(tmp_path.glob("*.safetensors"))
    second = disk_engine(tmp_path)
    try:
        from_b = ask(second, PROMPT, B)
        assert from_b.usage.cached_tokens == 0 and second.views.cache_stats()["disk"]["hits"] == 0
        second.views.flush_cache(B.namespace)  # B's own entries gone: A's file must remain
        from_a = ask(second, PROMPT, A)
        assert from_a.usage.cached_tokens > 40 and second.views.cache_stats()["disk"]["hits"] == 1
        assert same_answer(from_a, cold) and same_answer(from_b, cold)
    finally:
        second.shutdown()


def test_files_from_before_namespaces_are_never_served(tmp_path):
    engine = disk_engine(tmp_path)
    try:
        ask(engine, PROMPT, A)
        stored = engine.views.cache_sequences()
        # A checkpoint as a server before issue 19 wrote it: keyed by the bare model key.
        longest = max(stored, key=lambda s: s.info.tokens)
        snapshot = engine.store.get(longest.info.model_key, longest.tokens)
        assert engine.disk.cache.save(
            engine.model_key, longest.tokens, snapshot, CheckpointKind.HISTORY
        )
    finally:
        engine.shutdown()
    # No next-turn prefetch: its saves could land after the flush below.
    engine = disk_engine(tmp_path, prefetch=False)
    try:
        for pref in (CachePreference(), B):
            assert ask(engine, PROMPT, pref).usage.cached_tokens == 0
        assert engine.views.cache_stats()["disk"]["hits"] == 0
        old = [e for e in engine.disk.cache.entries() if e.model_key == engine.model_key]
        assert len(old) == 1  # indexed, never matched; a full flush removes it
        assert wait_for(lambda: engine.disk.pending == 0)  # this run's own saves, written
        engine.views.flush_cache()
        assert engine.disk.cache.entries() == []
    finally:
        engine.shutdown()


def test_a_running_prefetch_gives_way_to_another_namespace_extending_it():
    # A request of B extending A's prefetch cannot restore from it, so the prefetch must
    # give way (were it to go on, B's first token would wait for it: a timing tell).
    with open_engine(
        loaded_test_model("dense"), TEST_CACHE, EngineConfig(prefetch_delay_s=0.0)
    ) as engine:
        history = chat(
            ("system", "A long lesson about rivers and their deltas. " * 120),
            ("user", "Go on."),
        )
        rendered = engine.plan(history)
        longer = PromptInput(
            messages=(
                *history.messages,
                Message("assistant", "Rivers carry silt."),
                Message("user", "Why?"),
            )
        )
        assert extends(engine.plan(longer).tokens, rendered.tokens)
        # The prefetch starts, and its first chunk waits until B's request is in: B
        # arrives while the prefetch still has chunks to go, whatever the speed.
        with prefill_held(engine):
            engine._enqueue_prefetch(rendered, entry_key(engine.model_key, A))
            assert wait_for(lambda: engine.prefetch.started == 1)
            handle = engine.submit(longer, GREEDY, B)
        from_b = collect(handle)
        assert from_b.usage.cached_tokens == 0
        assert engine.prefetch.cancelled == 1 and engine.prefetch.completed == 0
        engine.store.check_integrity()
