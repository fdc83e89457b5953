"""Memory given back (platform.trim_heap / release_memory): glibc's malloc_trim on Linux
only, the engine trimming once per idle transition (never between the requests of a
burst), and an unloaded model's memory released. What RSS does is measured in
benchmarks/bench_memory.py, not asserted here."""

from __future__ import annotations

import sys
import threading

import pytest
from conftest import TEST_CACHE, loaded_test_model

from mlx_prefix import platform
from mlx_prefix.config import EngineConfig
from mlx_prefix.conversation import conversation_from_dicts
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import DoneEvent, PromptInput, SamplingParams
from mlx_prefix.server.served.loading import EngineSwapper, Slot
from mlx_prefix.server.served.names import ModelSpec, ServedModel


def test_trim_heap_runs_on_glibc_only(monkeypatch):
    expected = sys.platform.startswith("linux") and platform._glibc()
    monkeypatch.setattr(platform, "_TRIM", [])
    assert platform.trim_heap() is expected
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

    monkeypatch.setattr("mlx_prefix.engine.turns.trim_heap", count)
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
    monkeypatch.setattr("mlx_prefix.engine.turns.trim_heap", lambda: trims.append(1))
    engine = Engine(loaded_test_model("dense"), TEST_CACHE, EngineConfig(idle_trim_s=None))
    try:
        ask(engine, "A question?")
    finally:
        engine.shutdown()
    assert trims == []


def test_unloading_drops_the_weights_and_releases_memory(monkeypatch):
    released = []
    monkeypatch.setattr(platform, "release_memory", lambda: released.append(1))
    engine = Engine(load_model(str(cached_test_model("qwen3_5"))), TEST_CACHE)
    ask(engine, "Anything?")
    key = engine.model_key
    assert engine.store.sequences(key)
    swapper = EngineSwapper(lambda *a: engine, engine.store, None, last=engine)
    spec = ModelSpec(engine.model.path, None, "m")
    swapper.unload(Slot(spec, ServedModel("m", engine)), reason="test")
    assert released == [1]
    assert all(p.size == 0 for p in _params(engine)) and not engine.store.sequences(key)


def _params(engine: Engine) -> list:
    from mlx.utils import tree_flatten

    return [p for _, p in tree_flatten(engine.model.model.parameters())]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_process_rss_is_read():
    rss = platform.process_rss()
    assert rss is not None and rss > 10 << 20
