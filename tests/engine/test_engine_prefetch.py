"""Next-turn prefetch: the reply is prefilled again, on the grid, while the engine idles,
so the next turn restores the whole history and still answers like a cold run."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.engine_helpers import (
    GREEDY,
    chat,
    collect,
    open_engine,
    prefill_held,
    run,
    wait_for,
    warm_equals_cold,
)
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.config import DiskScope, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.keys import entry_key
from mlx_prefix.engine.requests.prefetch import next_turn_prompt, wants_prefetch
from mlx_prefix.records import CachePreference, PromptInput, SamplingParams
from mlx_prefix.server.protocol.messages import conversation_from_dicts

SYSTEM = "You are a patient tutor. Explain one idea at a time, in plain words. " * 3
NOW = EngineConfig(prefetch_delay_s=0.0)


def _spy_prefetch(engine: Engine) -> tuple[list, list]:
    """(finished, handed): the requests whose reply the engine has decided on (prefetch
    or not: the decision is made on the engine thread, after the request's last event),
    and the sources it handed the prefetcher. Once a request is in `finished`, whether
    it is prefetched is settled: no sleep needed, and a late wrong prefetch shows."""
    finished, handed = [], []
    on_reply, submit = engine.loop.decode._on_reply, engine.prefetcher.submit

    def deciding(job, reply):
        on_reply(job, reply)
        finished.append(job.handle.request_id)

    def handing(turn):
        handed.append(turn.source)
        return submit(turn)

    engine.loop.decode._on_reply, engine.prefetcher.submit = deciding, handing
    return finished, handed


def last_message_start(engine: Engine, prompt: PromptInput) -> int:
    return max(c.position for c in engine.plan(prompt).checkpoints if c.kind.name == "LAST_MESSAGE")


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "sliding"])
def test_the_next_turn_restores_the_whole_history_and_answers_like_a_cold_run(kind):
    with open_engine(loaded_test_model(kind), TEST_CACHE, NOW) as engine:
        history = [
            ("system", SYSTEM),
            ("user", "What is a fraction?"),
            ("assistant", "A part of a whole."),
            ("user", "And a decimal?"),
        ]
        second = run(engine, chat(*history))
        assert wait_for(lambda: engine.prefetch.completed == 1)
        assert engine.prefetch.tokens > 0
        third = chat(*history, ("assistant", second.text), ("user", "Which is easier?"))
        result = warm_equals_cold(engine, third)
        # Everything before the new message was restored: the reply included.
        assert result.usage.cached_tokens >= last_message_start(engine, third)
        assert result.usage.cached_tokens > second.usage.prompt_tokens
        engine.store.check_integrity()


def test_thinking_template_prefetch_matches_the_next_request():
    # The reply's <think> block is dropped when the next user message arrives; the
    # prefetched prompt must be what the next request renders, not what was generated.
    model = loaded_test_model("dense", think_template=True)
    with open_engine(model, TEST_CACHE, NOW) as engine:
        history = (
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "<think>\nTwo is prime.\n</think>\n\n2"},
            {"role": "user", "content": "Another one?"},
        )
        reply = "<think>\nThree works.\n</think>\n\n3"
        source = PromptInput(messages=conversation_from_dicts(history))
        prefetched = next_turn_prompt(
            engine.planner, source, reply, len(engine.plan(source).tokens)
        )
        assert prefetched is not None
        nxt = PromptInput(
            messages=conversation_from_dicts(
                [
                    *history,
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": "And a third?"},
                ]
            )
        )
        real = engine.plan(nxt).tokens
        assert real[: len(prefetched.tokens)] == prefetched.tokens
        assert len(prefetched.tokens) == last_message_start(engine, nxt)
        assert "Three works" not in model.tokenizer.decode(list(prefetched.tokens))


def test_one_shot_requests_are_not_prefetched():
    one_shot = PromptInput(
        messages=conversation_from_dicts([{"role": "user", "content": "Summarize this page."}])
    )
    assert not wants_prefetch(one_shot)
    chat_turn = PromptInput(
        messages=conversation_from_dicts(
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Look it up"},
            ]
        )
    )
    assert wants_prefetch(chat_turn)
    assert wants_prefetch(replace(one_shot, tools=({"type": "function"},)))
    assert not wants_prefetch(PromptInput(text="Once upon a time"))

    with open_engine(loaded_test_model("dense"), TEST_CACHE, NOW) as engine:
        finished, handed = _spy_prefetch(engine)
        run(engine, one_shot)
        assert wait_for(lambda: len(finished) == 1)  # the engine decided on its reply
        assert handed == [] and engine.prefetch.started == 0


def test_a_request_that_cannot_use_a_running_prefetch_takes_over():
    with open_engine(loaded_test_model("dense"), TEST_CACHE, NOW) as engine:
        long_history = chat(
            ("system", "A long lesson about rivers and their deltas. " * 120),
            ("user", "Go on."),
            ("assistant", "Rivers carry silt to the sea."),
            ("user", "Why?"),
        )
        rendered = engine.plan(long_history)
        # The prefetch starts, and its first chunk waits until the other request is in:
        # it arrives while the prefetch still has chunks to go, whatever the speed.
        with prefill_held(engine):
            engine._enqueue_prefetch(rendered, entry_key(engine.model_key, CachePreference()))
            assert wait_for(lambda: engine.prefetch.started == 1)
            handle = engine.submit(chat(("user", "Unrelated: what is two plus two?")), GREEDY)
        other = collect(handle)
        assert other.finish_reason in ("stop", "length")
        assert engine.prefetch.cancelled == 1 and engine.prefetch.completed == 0
        assert engine.prefetch.tokens < len(rendered.tokens)
        engine.store.check_integrity()


@pytest.mark.parametrize("enabled", [True, False])
def test_prefetch_can_be_turned_off(enabled):
    # No delay, and a control run: with the flag on, the same turn starts a prefetch well
    # within the time the "off" run is watched, so an ignored flag would show.
    config = EngineConfig(prefetch_next_turn=enabled, prefetch_delay_s=0.0)
    with open_engine(loaded_test_model("dense"), TEST_CACHE, config) as engine:
        history = chat(("user", "Hi"), ("assistant", "Hello."), ("user", "How are you?"))
        run(engine, history, sampling=SamplingParams(max_tokens=4))
        started = wait_for(lambda: engine.prefetch.started == 1, timeout=60.0 if enabled else 3.0)
        assert started is enabled
        assert engine.prefetch.started == int(enabled)


def test_a_chat_clients_first_turns_are_prefetched_once_it_sent_a_reply_back():
    with open_engine(loaded_test_model("qwen3_5"), TEST_CACHE, NOW) as engine:
        finished, handed = _spy_prefetch(engine)
        first = run(engine, chat(("system", SYSTEM), ("user", "What is a fraction?")))
        assert wait_for(lambda: len(finished) == 1)
        assert handed == [], "a first turn, from a client not known yet"
        # The reply comes back: this client continues conversations.
        run(engine, chat(("system", SYSTEM), ("user", "What is a fraction?"),
                         ("assistant", first.text), ("user", "And a decimal?")))  # fmt: skip
        assert wait_for(lambda: engine.prefetch.completed == 1)
        # A new conversation of the same client: its first turn is prefetched too.
        opening = [("system", SYSTEM), ("user", "What is a percentage?")]
        reply = run(engine, chat(*opening))
        assert wait_for(lambda: engine.prefetch.completed == 2)
        nxt = chat(*opening, ("assistant", reply.text), ("user", "Give an example."))
        result = warm_equals_cold(engine, nxt)
        assert result.usage.cached_tokens >= last_message_start(engine, nxt)
        assert result.usage.cached_tokens > reply.usage.prompt_tokens


def test_one_shot_clients_are_never_prefetched():
    with open_engine(loaded_test_model("dense"), TEST_CACHE, NOW) as engine:
        finished, handed = _spy_prefetch(engine)
        chat_system = ("system", SYSTEM)
        first = run(engine, chat(chat_system, ("user", "Hi")))
        run(engine, chat(chat_system, ("user", "Hi"), ("assistant", first.text), ("user", "Go")))
        assert wait_for(lambda: engine.prefetch.completed == 1)  # a chat client is known
        extension = ("system", "Summarize the page the user sends in one line.")
        for page in ("A page about owls.", "A page about tides.", "A page about bread."):
            run(engine, chat(extension, ("user", page)))  # the same instruction, no reply back
            run(engine, chat(("user", page)))  # no system prompt: nothing to know it by
        assert wait_for(lambda: len(finished) == 8)
        assert len(handed) == 1 and engine.prefetch.started == 1


@pytest.mark.parametrize("scope", [None, "off"])
def test_the_prefetch_keeps_to_the_requests_disk_scope(tmp_path, scope):
    """A chat sent with disk scope "off" has nothing written to disk, its next-turn
    prefetch included; without one the server's scope ("full" here) writes both."""
    from mlx_prefix.config import DiskConfig

    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    # Leaving the block shuts the engine down: it writes the queued disk saves first.
    with open_engine(loaded_test_model("dense"), TEST_CACHE, NOW, disk_config=disk) as engine:
        history = chat(
            ("system", SYSTEM),
            ("user", "What is a fraction?"),
            ("assistant", "A part of a whole."),
            ("user", "And a decimal?"),
        )
        pref = CachePreference(scope=DiskScope.parse(scope) if scope else None)
        handle = engine.submit(history, SamplingParams(max_tokens=4), pref)
        list(handle.events(timeout=120))
        assert wait_for(lambda: engine.prefetch.completed == 1)
    files = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert (len(files) > 0) is (scope is None), [p.name for p in files]


@pytest.mark.parametrize("scope", [None, "off"])
def test_a_pinned_warm_up_keeps_to_its_disk_scope(tmp_path, scope):
    from mlx_prefix.config import DiskConfig

    disk = DiskConfig(scope="auto", directory=str(tmp_path), min_tokens=16)
    # Leaving the block shuts the engine down: it writes the queued disk saves first.
    with open_engine(loaded_test_model("dense"), TEST_CACHE, NOW, disk_config=disk) as engine:
        prompt = chat(("system", SYSTEM), ("user", "Warm me."))
        assert engine.warm(
            prompt, pin=True, cache=CachePreference(scope=DiskScope.parse(scope) if scope else None)
        ).pinned
    files = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert (len(files) > 0) is (scope is None)  # pinned: "full" unless told otherwise
