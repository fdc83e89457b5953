"""The live server the server's test modules share, and what talks to it.

`live = live_server(...)` in a module makes its `live` fixture, module-scoped, yielding
(base URL, engine): `live` means that in every module. tests/conftest.py derives the rest
from it: `url`, `engine`, `http` (an httpx client), `client` (OpenAI's SDK) and `claude`
(Anthropic's). A test that starts a server of its own reaches it with `openai_client`,
`anthropic_client` and `post_chat`.

`engine` makes the engine served (a FakeEngine by default): called with the fixture's
param when `params` are given, and either an engine or a context manager yielding one
(an engine that needs something around it for its whole life, a patched sampler). The
server shuts the engine down when the module is done (server_fakes.serving)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anthropic
import httpx
import openai
import pytest

from support.server_fakes import FakeEngine, FakeModel, FakeTokenizer, serving

CHAT = "/v1/chat/completions"


def live_server(
    engine: Callable[..., Any] | None = None,
    *,
    params: Sequence[Any] | None = None,
    name: str = "live",
    embeddings: bool = False,
    **settings: Any,
) -> Any:
    """The fixture (named `name`); `settings` are the server's (ServerSettings).
    `embeddings`: the tiny embedding model (conftest's `embedding_model`) is served beside
    the engine."""

    @pytest.fixture(scope="module", params=params, name=name)
    def live(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
        made = engine(*([request.param] if params is not None else [])) if engine else None
        opened = made if hasattr(made, "__enter__") else contextlib.nullcontext(made)
        served_beside = request.getfixturevalue("embedding_model") if embeddings else None
        with opened as served, serving(served, embeddings=served_beside, **settings) as running:
            yield running

    return live


def tool_calling_engine(**model: Any) -> FakeEngine:
    """A fake engine whose tokenizer knows Qwen's JSON tool-call markers."""
    return FakeEngine(FakeModel(tokenizer=FakeTokenizer.with_json_tools(), **model))


def openai_client(url: str, api_key: str = "x", path: str = "/v1", **options: Any) -> openai.OpenAI:
    """OpenAI's SDK on the server at `url` (its API under `path`), never retrying (a retry
    would hide a failure and post twice); `options`: the SDK's (default_headers=...). Use
    it in a `with` block, which closes it."""
    return openai.OpenAI(base_url=url + path, api_key=api_key, max_retries=0, **options)


def anthropic_client(url: str, api_key: str = "x", **options: Any) -> anthropic.Anthropic:
    """Anthropic's SDK on the server at `url`, never retrying; close it with `with`."""
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, **options)


def post_chat(
    server: httpx.Client | str, body: dict, *, path: str = CHAT, timeout: float = 300, **kw: Any
) -> dict:
    """POSTs `body` to a chat route of `server` (a client, or a base URL), asserts a 200
    and returns the reply's JSON. `kw` goes to httpx (headers=...)."""
    if isinstance(server, str):
        r = httpx.post(server + path, json=body, timeout=timeout, **kw)
    else:
        r = server.post(path, json=body, **kw)
    assert r.status_code == 200, r.text
    return r.json()
