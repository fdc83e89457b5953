"""The live server the server's test modules share: `live = live_server(...)` in a module
makes its `live` fixture, module-scoped, yielding (base URL, engine).

`engine` makes the engine served (a FakeEngine by default): called with the fixture's
param when `params` are given, and either an engine or a context manager yielding one
(an engine that needs something around it for its whole life, a patched sampler). The
server shuts the engine down when the module is done (server_fakes.serving)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from support.server_fakes import FakeEngine, FakeModel, FakeTokenizer, serving


def live_server(
    engine: Callable[..., Any] | None = None,
    *,
    params: Sequence[Any] | None = None,
    name: str = "live",
    **settings: Any,
) -> Any:
    """The fixture (named `name`); `settings` are the server's (ServerSettings)."""

    @pytest.fixture(scope="module", params=params, name=name)
    def live(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
        made = engine(*([request.param] if params is not None else [])) if engine else None
        opened = made if hasattr(made, "__enter__") else contextlib.nullcontext(made)
        with opened as served, serving(served, **settings) as (url, running):
            yield url, running

    return live


def tool_calling_engine(**model: Any) -> FakeEngine:
    """A fake engine whose tokenizer knows Qwen's JSON tool-call markers."""
    return FakeEngine(FakeModel(tokenizer=FakeTokenizer.with_json_tools(), **model))
