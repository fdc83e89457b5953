"""The disk tier through the engine: restarts hit, policies decide what is written."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TEST_CACHE, loaded_test_model
from engine_helpers import EXACT, chat, run

from mlx_prefix.config import DiskConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import CachePreference, SamplingParams

SYSTEM = "You are the front desk of a hotel. Answer guests kindly and in one sentence. " * 5


def engine_on(kind: str, directory, scope: str) -> Engine:
    disk = DiskConfig(scope=scope, directory=str(directory), min_tokens=16)
    return Engine(loaded_test_model(kind), TEST_CACHE, disk_config=disk)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_restart_hits_the_disk_and_gives_the_cold_answer(tmp_path, kind):
    prompt = chat(("system", SYSTEM), ("user", "Is breakfast included?"))
    first = engine_on(kind, tmp_path, "full")
    cold = run(first, prompt, cache=False)
    run(first, prompt)
    first.shutdown()  # writes what is still queued
    assert list(tmp_path.glob("*.safetensors"))

    second = engine_on(kind, tmp_path, "full")
    try:
        warm = run(second, chat(("system", SYSTEM), ("user", "Is breakfast included?")))
        assert warm.usage.cached_tokens >= warm.usage.prompt_tokens - 3
        assert warm.tokens == cold.tokens
        assert second.cache_stats()["disk"]["hits"] == 1
    finally:
        second.shutdown()


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "nemotron_h"])
def test_one_request_a_restart_and_the_same_request_hits(tmp_path, kind):
    # A 1K-token system prompt, seen once: `auto` persists it the first time.
    system = " ".join(f"Rule {i}: greet every guest by name and offer water." for i in range(80))
    prompt = chat(("system", system), ("user", "Is breakfast included?"))
    first = engine_on(kind, tmp_path, "auto")
    system_end = max(c.position for c in first.plan(prompt).checkpoints if c.kind.name == "SYSTEM")
    assert system_end >= 1000
    run(first, prompt, sampling=EXACT)
    first.shutdown()

    second = engine_on(kind, tmp_path, "auto")
    try:
        warm = run(second, prompt, sampling=EXACT)
        assert warm.usage.cached_tokens >= system_end
        assert second.cache_stats()["disk"]["hits"] == 1
        cold = run(second, prompt, cache=False, sampling=EXACT)
        assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)
    finally:
        second.shutdown()


def test_auto_persists_the_prefix_shared_by_recent_requests(tmp_path):
    engine = engine_on("qwen3_5", tmp_path, "auto")
    run(engine, chat(("system", SYSTEM), ("user", "Where is the pool?")))
    engine.shutdown()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1, "the system prompt, first seen"

    engine = engine_on("qwen3_5", tmp_path, "auto")
    run(engine, chat(("system", SYSTEM), ("user", "Where is the pool?")))
    run(engine, chat(("system", SYSTEM), ("user", "When is checkout?")))
    engine.shutdown()
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1  # what the two share is the system prompt already on disk

    engine = engine_on("qwen3_5", tmp_path, "auto")
    try:
        third = chat(("system", SYSTEM), ("user", "Can I get a late checkout?"))
        result = run(engine, third)
        system_end = max(
            c.position for c in engine.plan(third).checkpoints if c.kind.name == "SYSTEM"
        )
        assert result.usage.cached_tokens >= system_end
    finally:
        engine.shutdown()


def test_per_request_scope_off_writes_nothing_and_bad_scopes_are_refused(tmp_path):
    engine = engine_on("dense", tmp_path, "full")
    try:
        handle = engine.submit(
            chat(("system", SYSTEM), ("user", "Hi")),
            SamplingParams(max_tokens=3),
            CachePreference(scope="off"),
        )
        list(handle.events(timeout=60))
        with pytest.raises(InvalidRequest):
            engine.submit(chat(("user", "Hi")), SamplingParams(), CachePreference(scope="most"))
    finally:
        engine.shutdown()
    assert not list(tmp_path.glob("*.safetensors"))


def test_a_few_shared_tokens_are_not_worth_reading_a_file(tmp_path):
    engine = engine_on("dense", tmp_path, "full")
    run(engine, chat(("system", SYSTEM), ("user", "Is breakfast included?")))
    engine.shutdown()
    engine = engine_on("dense", tmp_path, "full")
    try:
        other = run(engine, chat(("system", "A different prompt."), ("user", "Hello")))
        assert other.usage.cached_tokens == 0
        assert engine.cache_stats()["disk"]["hits"] == 0
    finally:
        engine.shutdown()


def test_files_from_another_chunk_grid_are_never_served(tmp_path):
    # A checkpoint computed on another grid would not reproduce this engine's cold run.
    prompt = chat(("system", SYSTEM), ("user", "Is breakfast included?"))
    first = engine_on("dense", tmp_path, "full")
    run(first, prompt)
    first.shutdown()
    assert list(tmp_path.glob("*.safetensors"))

    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    other_grid = dataclasses.replace(TEST_CACHE, prefill_chunk=16)
    second = Engine(loaded_test_model("dense"), other_grid, disk_config=disk)
    try:
        assert second.model_key != first.model_key
        assert run(second, prompt).usage.cached_tokens == 0
        assert second.cache_stats()["disk"]["hits"] == 0
    finally:
        second.shutdown()


def test_auto_persists_the_shared_prefix_even_when_memory_restored_past_it(tmp_path):
    # Seed 004's lesson, through memory: the second request restores the whole shared
    # document from memory (past the chat boundary `auto` chose), and the boundary must
    # still reach the disk.
    config = dataclasses.replace(TEST_CACHE, checkpoint_interval=4096)
    disk = DiskConfig(scope="auto", directory=str(tmp_path), min_tokens=16)
    document = "The hotel has a pool, a gym, two restaurants and a garden. " * 12

    def ask(engine, question):
        # Long questions: no checkpoint of the prompt falls inside the shared document.
        return run(engine, chat(("system", SYSTEM), ("user", document + question * 8)))

    first = Engine(loaded_test_model("dense"), config, disk_config=disk)
    ask(first, "Where is the pool? ")
    second = ask(first, "When does the gym open? ")
    first.shutdown()
    # The user message's start (where the system prompt ends): the boundary auto keeps.
    boundary = max(
        c.position
        for c in first.plan(chat(("system", SYSTEM), ("user", document + "x"))).checkpoints
        if c.kind.name in ("SYSTEM", "LAST_MESSAGE")
    )
    assert second.usage.cached_tokens > boundary  # memory restored past the boundary
    assert list(tmp_path.glob("*.safetensors")), "the chosen prefix never reached the disk"

    restarted = Engine(loaded_test_model("dense"), config, disk_config=disk)
    try:
        third = ask(restarted, "Is there a garden? ")
        assert third.usage.cached_tokens >= boundary
        assert restarted.cache_stats()["disk"]["hits"] == 1
    finally:
        restarted.shutdown()
