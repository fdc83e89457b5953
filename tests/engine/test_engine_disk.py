"""The disk tier through the engine: restarts hit, policies decide what is written."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from contextlib import AbstractContextManager

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from support.engine_helpers import EXACT, chat, open_engine, run, wait_for, warm_equals_cold
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.snapshot import capture
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.config import DiskConfig, DiskScope
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.prefill import disk_access as disk_tier
from mlx_prefix.engine.prefill.disk_access import MAX_PENDING_SAVES, DiskAccess
from mlx_prefix.records import CachePreference, SamplingParams

SYSTEM = "You are the front desk of a hotel. Answer guests kindly and in one sentence. " * 5


def engine_on(kind: str, directory, scope: str) -> AbstractContextManager[Engine]:
    """An engine with a disk tier, shut down (writing what is still queued) when the
    `with` block ends."""
    disk = DiskConfig(scope=scope, directory=str(directory), min_tokens=16)
    return open_engine(loaded_test_model(kind), TEST_CACHE, disk_config=disk)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_restart_hits_the_disk_and_gives_the_cold_answer(tmp_path, kind):
    prompt = chat(("system", SYSTEM), ("user", "Is breakfast included?"))
    with engine_on(kind, tmp_path, "full") as first:
        cold = run(first, prompt, cache=False)
        run(first, prompt)
    assert list(tmp_path.glob("*.safetensors"))

    with engine_on(kind, tmp_path, "full") as second:
        warm = run(second, chat(("system", SYSTEM), ("user", "Is breakfast included?")))
        assert warm.usage.cached_tokens >= warm.usage.prompt_tokens - 3
        assert warm.tokens == cold.tokens
        assert second.views.cache_stats()["disk"]["hits"] == 1


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "nemotron_h"])
def test_one_request_a_restart_and_the_same_request_hits(tmp_path, kind):
    # A 1K-token system prompt, seen once: `auto` persists it the first time.
    system = " ".join(f"Rule {i}: greet every guest by name and offer water." for i in range(80))
    prompt = chat(("system", system), ("user", "Is breakfast included?"))
    with engine_on(kind, tmp_path, "auto") as first:
        plan = first.plan(prompt)
        system_end = max(c.position for c in plan.checkpoints if c.kind.name == "SYSTEM")
        assert system_end >= 1000
        run(first, prompt, sampling=EXACT)

    with engine_on(kind, tmp_path, "auto") as second:
        warm = run(second, prompt, sampling=EXACT)
        assert warm.usage.cached_tokens >= system_end
        assert second.views.cache_stats()["disk"]["hits"] == 1
        cold = run(second, prompt, cache=False, sampling=EXACT)
        assert (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)


def test_auto_persists_the_prefix_shared_by_recent_requests(tmp_path):
    with engine_on("qwen3_5", tmp_path, "auto") as engine:
        run(engine, chat(("system", SYSTEM), ("user", "Where is the pool?")))
    assert len(list(tmp_path.glob("*.safetensors"))) == 1, "the system prompt, first seen"

    with engine_on("qwen3_5", tmp_path, "auto") as engine:
        run(engine, chat(("system", SYSTEM), ("user", "Where is the pool?")))
        run(engine, chat(("system", SYSTEM), ("user", "When is checkout?")))
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1  # what the two share is the system prompt already on disk

    with engine_on("qwen3_5", tmp_path, "auto") as engine:
        third = chat(("system", SYSTEM), ("user", "Can I get a late checkout?"))
        result = warm_equals_cold(engine, third)  # restored from disk, answers like cold
        system_end = max(
            c.position for c in engine.plan(third).checkpoints if c.kind.name == "SYSTEM"
        )
        assert result.usage.cached_tokens >= system_end
        assert engine.views.cache_stats()["disk"]["hits"] == 1


@pytest.mark.parametrize("scope", ["off", None])
def test_per_request_scope_off_writes_nothing_and_bad_scopes_are_refused(tmp_path, scope):
    # None (the server's "full") is the control: the same request does write.
    with engine_on("dense", tmp_path, "full") as engine:
        handle = engine.submit(
            chat(("system", SYSTEM), ("user", "Hi")),
            SamplingParams(max_tokens=3),
            CachePreference(scope=DiskScope.parse(scope) if scope else None),
        )
        list(handle.events(timeout=60))
        with pytest.raises(ValueError):  # parsed where it enters (server/protocol/request.py)
            CachePreference(scope=DiskScope.parse("most"))
    assert len(list(tmp_path.glob("*.safetensors"))) == (0 if scope == "off" else 1)


def test_a_few_shared_tokens_are_not_worth_reading_a_file(tmp_path):
    with engine_on("dense", tmp_path, "full") as engine:
        run(engine, chat(("system", SYSTEM), ("user", "Is breakfast included?")))
    with engine_on("dense", tmp_path, "full") as engine:
        other = run(engine, chat(("system", "A different prompt."), ("user", "Hello")))
        assert other.usage.cached_tokens == 0
        assert engine.views.cache_stats()["disk"]["hits"] == 0


def test_files_from_another_chunk_grid_are_never_served(tmp_path):
    # A checkpoint computed on another grid would not reproduce this engine's cold run.
    prompt = chat(("system", SYSTEM), ("user", "Is breakfast included?"))
    with engine_on("dense", tmp_path, "full") as first:
        run(first, prompt)
    assert list(tmp_path.glob("*.safetensors"))

    disk = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=16)
    other_grid = dataclasses.replace(TEST_CACHE, prefill_chunk=16)
    with open_engine(loaded_test_model("dense"), other_grid, disk_config=disk) as second:
        assert second.model_key != first.model_key
        assert run(second, prompt).usage.cached_tokens == 0
        assert second.views.cache_stats()["disk"]["hits"] == 0


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

    with open_engine(loaded_test_model("dense"), config, disk_config=disk) as first:
        ask(first, "Where is the pool? ")
        second = ask(first, "When does the gym open? ")
    # The user message's start (where the system prompt ends): the boundary auto keeps.
    boundary = max(
        c.position
        for c in first.plan(chat(("system", SYSTEM), ("user", document + "x"))).checkpoints
        if c.kind.name in ("SYSTEM", "LAST_MESSAGE")
    )
    assert second.usage.cached_tokens > boundary  # memory restored past the boundary
    assert list(tmp_path.glob("*.safetensors")), "the chosen prefix never reached the disk"

    with open_engine(loaded_test_model("dense"), config, disk_config=disk) as restarted:
        question = chat(("system", SYSTEM), ("user", document + "Is there a garden? " * 8))
        third = warm_equals_cold(restarted, question)
        assert third.usage.cached_tokens >= boundary
        assert restarted.views.cache_stats()["disk"]["hits"] == 1


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= 30 and text in r.getMessage()]


def test_a_chosen_save_below_the_restore_point_is_logged_when_memory_lost_it(tmp_path, caplog):
    # A non-trimmable cache restored from memory past the chosen position can only save
    # it from an exact state memory holds; when none is there the save is dropped, and
    # says so (seed 004's "a chosen save never fires", issue 20 item 8).
    # Long enough for a multiple of the chunk size that no checkpoint is planned at.
    prompt = chat(("system", SYSTEM), ("user", "Is breakfast included? " * 12))
    with engine_on("qwen3_5", tmp_path / "probe", "full") as probe:
        plan = probe.plan(prompt)
        planned = {c.position for c in plan.checkpoints}
        grid = probe.planner.grid
        p = next(
            n for n in range(32, len(plan.tokens), 32)
            if n not in planned and grid.align(plan.tokens, n) == n
        )  # fmt: skip
    scope = CachePreference(scope=DiskScope.parse(str(p)))
    sampling = SamplingParams(max_tokens=2)

    def serve(engine, pref):
        handle = engine.submit(prompt, sampling, pref)
        return [e for e in handle.events(timeout=60)][-1].usage

    # Control: on a cold engine that position is saved.
    with engine_on("qwen3_5", tmp_path / "cold", "full") as cold:
        serve(cold, scope)
    assert len(list((tmp_path / "cold").glob("*.safetensors"))) == 1

    with engine_on("qwen3_5", tmp_path / "warm", "full") as engine:
        # Memory keeps the planned checkpoints.
        serve(engine, CachePreference(scope=DiskScope.parse("off")))
        with caplog.at_level(logging.WARNING, "mlx_prefix.engine"):
            usage = serve(engine, scope)
        assert usage.cached_tokens > p  # restored from memory past the chosen position
        (line,) = _warnings(caplog, "dropped")
        assert f"{p}-token prefix" in line
        assert engine.views.cache_stats()["disk"]["dropped_saves"] == 1
    assert not list((tmp_path / "warm").glob("*.safetensors"))

    # Where the disk already holds that prefix, nothing is lost and nothing is logged.
    caplog.clear()
    with engine_on("qwen3_5", tmp_path / "cold", "full") as again:
        serve(again, CachePreference(scope=DiskScope.parse("off")))
        with caplog.at_level(logging.WARNING, "mlx_prefix.engine"):
            serve(again, scope)
        assert not _warnings(caplog, "dropped")
        assert again.views.cache_stats()["disk"]["dropped_saves"] == 0


def _hold_writes(monkeypatch, engine: Engine) -> threading.Event:
    """Hold the disk writer: the engine writes no queued save until the returned event
    is set (the queue's own bound, 16, is not reached here)."""
    gate, due = threading.Event(), engine.disk.due
    monkeypatch.setattr(
        engine.disk, "due", lambda busy, decoding=False: gate.is_set() and due(busy, decoding)
    )
    return gate


def _queue_saves(monkeypatch, engine: Engine, count: int) -> threading.Event:
    """`count` requests at once, each leaving one save in the queue, all of them still
    there when the last request ended (the writer is held until the returned event is
    set), whatever the machine's speed."""
    gate = _hold_writes(monkeypatch, engine)
    handles = [
        engine.submit(
            chat(("system", f"Guest {i}. " + SYSTEM), ("user", "Hello")),
            SamplingParams(max_tokens=2),
        )
        for i in range(count)
    ]
    for handle in handles:
        list(handle.events(timeout=60))
    assert engine.disk.pending == count
    return gate


def test_shutdown_writes_every_queued_save(tmp_path, monkeypatch):
    # More queued writing than the old fixed 5 s after the grace period: all of it lands.
    with engine_on("dense", tmp_path, "full") as engine:
        real = engine.disk.cache.save

        def slow(*args, **kwargs):
            time.sleep(1.2)
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.disk.cache, "save", slow)
        _queue_saves(monkeypatch, engine, 5).set()
        engine.shutdown(timeout=0.1)
    assert not engine._thread.is_alive()
    assert len(list(tmp_path.glob("*.safetensors"))) == 5
    assert engine.disk.pending == 0 and engine.disk.dropped == 0


def test_shutdown_out_of_time_drops_queued_saves_with_a_line_each(tmp_path, monkeypatch, caplog):
    with engine_on("dense", tmp_path, "full") as engine:
        real, started = engine.disk.cache.save, []

        def until_out_of_time(*args, **kwargs):
            # The save being written when the shutdown's time for saves runs out.
            started.append(args[1])
            assert wait_for(lambda: engine.turns._abandon_saves)
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.disk.cache, "save", until_out_of_time)
        _queue_saves(monkeypatch, engine, 4).set()
        with caplog.at_level(logging.WARNING, "mlx_prefix.engine"):
            engine.shutdown(timeout=0.1, save_timeout=0.3)
            engine._thread.join(60)  # a deadline for a hang: that save ends, the rest drop
    assert not engine._thread.is_alive()
    written = len(list(tmp_path.glob("*.safetensors")))
    dropped = _warnings(caplog, "dropped")
    assert len(started) == written == 1
    assert len(dropped) == engine.disk.dropped == 3 and engine.disk.pending == 0
    assert all("ran out" in line for line in dropped)


def _kv_snapshot(n: int, seed: int):
    c = KVCache()
    k = mx.random.normal((1, 2, n, 16), key=mx.random.key(seed))  # [B, H, L, D]
    c.update_and_fetch(k, k)
    return capture([c], n)


def test_the_save_queue_is_bounded_and_counted_in_the_byte_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "MAX_SAVE_DELAY_S", 3600.0)  # busy: nothing overdue
    store = PromptCache(budget_bytes=1 << 30)
    config = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=1)
    tier = DiskAccess(config, True, store, bytes_key="disk")
    snaps = [_kv_snapshot(8, i) for i in range(MAX_PENDING_SAVES + 3)]
    size = snaps[0].nbytes
    for i, snap in enumerate(snaps):
        tier.defer("m", [i] * 8, snap, CheckpointKind.HISTORY)
        tier.write_pending(busy=True)
        assert tier.pending == min(i + 1, MAX_PENDING_SAVES)
        assert store.stats().active_bytes == tier.pending * size
    assert tier.cache.stats().saves == 3  # a full queue wrote its oldest: nothing dropped
    # A snapshot the store holds is counted once, by the store.
    held = _kv_snapshot(8, 99)
    assert store.insert("m", [99] * 8, held, CheckpointKind.HISTORY)
    tier.defer("m", [99] * 8, held, CheckpointKind.HISTORY)
    assert store.stats().active_bytes == (MAX_PENDING_SAVES - 1) * size
    while tier.pending:
        tier.write_pending(busy=False)
    assert store.stats().active_bytes == 0 and tier.dropped == 0
    assert tier.cache.stats().saves == len(snaps) + 1
    store.check_integrity()


def test_a_save_being_written_still_counts_as_pending(tmp_path, monkeypatch):
    # Another thread (/v1/cache, a caller waiting for the files) that reads 0 pending
    # saves finds every file written.
    store = PromptCache(budget_bytes=1 << 30)
    config = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=1)
    tier = DiskAccess(config, True, store, bytes_key="disk")
    real, seen = tier.cache.save, []

    def save(*args, **kwargs):
        seen.append((tier.pending, len(list(tmp_path.glob("*.safetensors")))))
        return real(*args, **kwargs)

    monkeypatch.setattr(tier.cache, "save", save)
    tier.defer("m", [1] * 8, _kv_snapshot(8, 1), CheckpointKind.HISTORY)
    tier.write_pending(busy=False)
    assert seen == [(1, 0)]
    assert tier.pending == 0 and len(list(tmp_path.glob("*.safetensors"))) == 1


def test_no_save_is_written_between_two_tokens_of_a_running_request(tmp_path, monkeypatch):
    """An overdue save waits while requests decode (a dense snapshot's write was a whole
    gap between two tokens of every running request), and goes once only prefill runs;
    a full queue still writes its oldest."""
    monkeypatch.setattr(disk_tier, "MAX_SAVE_DELAY_S", 0.0)  # every queued save overdue
    store = PromptCache(budget_bytes=1 << 30)
    config = DiskConfig(scope="full", directory=str(tmp_path), min_tokens=1)
    tier = DiskAccess(config, True, store, bytes_key="disk")
    tier.defer("m", [1] * 8, _kv_snapshot(8, 1), CheckpointKind.HISTORY)
    assert not tier.due(busy=True, decoding=True)
    tier.write_pending(busy=True, decoding=True)
    assert tier.pending == 1 and tier.cache.stats().saves == 0
    tier.write_pending(busy=True)  # prefill only: the overdue save goes
    assert tier.pending == 0 and tier.cache.stats().saves == 1
    for i in range(MAX_PENDING_SAVES + 1):
        tier.defer("m", [2 + i] * 8, _kv_snapshot(8, 2 + i), CheckpointKind.HISTORY)
        tier.write_pending(busy=True, decoding=True)
    assert tier.pending == MAX_PENDING_SAVES and tier.cache.stats().saves == 2
