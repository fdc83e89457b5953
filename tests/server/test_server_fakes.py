"""The fake engine the server's tests run against (server_fakes.FakeEngine) is held to
the engine's interface (engine/interface.EngineAPI): the same methods, each with the
same parameters (names, kinds, which have defaults), and so are its cache views
(`engine.views`, CacheViewsAPI), so a test that passes on the fake calls the engine the
way the server does."""

from __future__ import annotations

import inspect

import pytest
from support.server_fakes import FakeEngine

from mlx_prefix.engine.interface import CacheViewsAPI, EngineAPI


def methods(protocol: type) -> list[str]:
    return sorted(
        name
        for name, member in vars(protocol).items()
        if inspect.isfunction(member) and not name.startswith("_")
    )


METHODS = methods(EngineAPI)
VIEW_METHODS = methods(CacheViewsAPI)


def shape(function) -> list[tuple[str, inspect._ParameterKind, bool]]:
    """A signature as (name, kind, has a default) per parameter, `self` left out."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in parameters]


def test_the_protocol_names_the_methods_the_server_calls():
    assert {"submit", "start_warm", "count_tokens", "shutdown"} <= set(METHODS)
    assert {"cache_stats", "flush_cache", "set_pinned", "evict_entry"} <= set(VIEW_METHODS)


@pytest.mark.parametrize("name", METHODS)
def test_the_fake_has_each_method_with_the_protocols_parameters(name):
    fake = getattr(FakeEngine, name, None)
    assert callable(fake), f"FakeEngine has no {name}()"
    assert shape(fake) == shape(getattr(EngineAPI, name))


@pytest.mark.parametrize("name", VIEW_METHODS)
def test_the_fakes_views_have_each_method_with_the_protocols_parameters(name):
    engine = FakeEngine()
    fake = getattr(type(engine.views), name, None)
    assert callable(fake), f"FakeEngine.views has no {name}()"
    assert shape(fake) == shape(getattr(CacheViewsAPI, name))
    engine.shutdown()


def test_the_fake_has_the_protocols_attributes():
    engine = FakeEngine()
    for name in [*inspect.get_annotations(EngineAPI), "views"]:
        assert hasattr(engine, name), f"FakeEngine has no {name}"
    engine.shutdown()
