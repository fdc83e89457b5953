"""Memory given back (platform.trim_heap / release_memory): glibc's malloc_trim on Linux
only, and there the freed heap really leaves the process (in a subprocess: RSS falls by
what was freed); the engine trimming once per idle transition (never between the
requests of a burst); an unloaded model's weights dropped and MLX's freed buffers and the
heap released, by the real functions. An unloaded model's RSS: test_unload_release.py."""

from __future__ import annotations

import json
import os
import platform as stdlib_platform
import subprocess
import sys
import threading

import mlx.core as mx
import pytest
from support.models import TEST_CACHE, loaded_test_model
from support.paths import REPO

from mlx_prefix import platform
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import DoneEvent, PromptInput, SamplingParams
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.server.served.loading import EngineSwapper, Slot
from mlx_prefix.server.served.names import ModelSpec, ServedModel

# Freed heap glibc keeps: 1 KiB blocks (malloc's, above pymalloc's 512 bytes) below one
# kept at the top of the heap, so that free() cannot shrink it; trim_heap must give them
# back. Prints RSS after the frees, then after the trim, and what trim_heap answered.
_FREED_HEAP = """
import gc, json
from mlx_prefix import platform
blocks = [bytes(1000) + bytes([i % 256]) for i in range(300_000)]
top = blocks[-1]
del blocks
gc.collect()
freed = platform.process_rss()
ran = platform.trim_heap()
print(json.dumps({"freed": freed, "trimmed": platform.process_rss(), "ran": ran}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or stdlib_platform.libc_ver()[0] != "glibc",
    reason="malloc_trim is glibc's",
)
def test_trim_heap_gives_the_freed_heap_back_on_glibc():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _FREED_HEAP], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    assert rss["ran"] is True
    assert rss["freed"] - rss["trimmed"] > 200 << 20, rss  # ~300 MB were freed


def test_trim_heap_leaves_other_systems_alone(monkeypatch):
    monkeypatch.setattr(platform, "_TRIM", [])
    monkeypatch.setattr(platform.sys, "platform", "darwin")
    assert platform.trim_heap() is False  # macOS: left alone
    monkeypatch.setattr(platform, "_TRIM", [])
    monkeypatch.setattr(platform.sys, "platform", "linux")

    def musl(name: str) -> str:
        raise ValueError(name)  # musl has no CS_GNU_LIBC_VERSION

    monkeypatch.setattr(platform.os, "confstr", musl)
    assert platform.trim_heap() is False


def ask(engine: Engine, text: str) -> DoneEvent:
    prompt = PromptInput(messages=conversation_from_dicts([{"role": "user", "content": text}]))
    handle = engine.submit(prompt, SamplingParams(max_tokens=3))
    return [e for e in handle.events() if isinstance(e, DoneEvent)][0]


def test_the_engine_trims_once_per_idle_transition(monkeypatch):
    trims = []
    trimmed = threading.Event()

    def count() -> bool:
        trims.append(1)
        trimmed.set()
        return True

    monkeypatch.setattr("mlx_prefix.engine.driver.trim_heap", count)
    config = EngineConfig(idle_trim_s=0.05, prefetch_next_turn=False)
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, config)
    try:
        ask(engine, "First question?")
        assert trimmed.wait(60)
        trimmed.clear()
        ask(engine, "Second question?")
        assert trimmed.wait(60)
    finally:
        engine.shutdown()
    assert len(trims) == 2  # one per idle transition: none at startup, none while idle


def test_an_idle_trim_of_none_is_off(monkeypatch):
    trims = []
    monkeypatch.setattr("mlx_prefix.engine.driver.trim_heap", lambda: trims.append(1))
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, EngineConfig(idle_trim_s=None))
    try:
        ask(engine, "A question?")
    finally:
        engine.shutdown()
    assert trims == []


def test_unloading_drops_the_weights_and_releases_memory(monkeypatch):
    trims = []
    real_trim = platform.trim_heap

    def trim() -> bool:  # the real one, counted
        trims.append(1)
        return real_trim()

    monkeypatch.setattr(platform, "trim_heap", trim)
    engine = Engine(load_model(str(cached_test_model("qwen3_5"))), TEST_CACHE)
    ask(engine, "Anything?")
    key = engine.model_key
    assert engine.store.sequences(key)
    assert mx.get_cache_memory() > 0  # the request's freed buffers, kept for reuse
    swapper = EngineSwapper(lambda *a: engine, engine.store, None, last=engine)
    spec = ModelSpec(engine.model.path, None, "m")
    swapper.unload(Slot(spec, ServedModel("m", engine)), reason="test")
    assert mx.get_cache_memory() == 0 and trims == [1]
    assert all(p.size == 0 for p in _params(engine)) and not engine.store.sequences(key)


def _params(engine: Engine) -> list:
    from mlx.utils import tree_flatten

    return [p for _, p in tree_flatten(engine.model.model.parameters())]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_process_rss_is_read():
    rss = platform.process_rss()
    assert rss is not None and rss > 10 << 20
