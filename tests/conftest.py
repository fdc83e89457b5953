from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import httpx
import ollama
import pytest
from support.live import anthropic_client, openai_client
from support.models import TEST_CACHE, loaded_test_model
from support.paths import WEB

from mlx_prefix.config import EngineConfig
from mlx_prefix.embeddings.model import load_embedding_model
from mlx_prefix.embeddings.testing import make_embedding_test_model
from mlx_prefix.engine.decode import lookup
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.lookup.cost import VerifyCost


@pytest.fixture(autouse=True)
def untimed_verify_cost(monkeypatch):
    """Prompt lookup prices a verify by the engine's own timings (engine/forward/
    cost.py); on a loaded CPU those would decide which drafts a test sees, so
    tests price every verify at the prior (tests/engine/test_engine_lookup_cost.py
    measures with its own timings)."""
    monkeypatch.setattr(VerifyCost, "stepped", lambda self, rows, seconds: None)
    monkeypatch.setattr(VerifyCost, "verified", lambda self, rows, width, seconds: None)


@pytest.fixture
def verified_rows(monkeypatch) -> list[list[int]]:
    """Each several-row verify step's draft lengths, one per row."""
    seen: list[list[int]] = []
    verify_rows = lookup.verify_rows

    def spy(batch, drafts, accept, stats):
        seen.append([len(d) for d in drafts])
        return verify_rows(batch, drafts, accept, stats)

    monkeypatch.setattr(lookup, "verify_rows", spy)
    return seen


@pytest.fixture
def make_engine():
    engines: list[Engine] = []

    def make(
        kind: str = "dense",
        think_template: bool = False,
        cache_config=TEST_CACHE,
        deterministic: bool = False,
    ):
        """An engine on a tiny test model; `deterministic`: batch-invariant decode."""
        config = EngineConfig(deterministic=deterministic)
        engine = Engine(loaded_test_model(kind, think_template), cache_config, config)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="session")
def embedding_model(tmp_path_factory):
    """The tiny embedding model `tiny-embed` (a live_server(embeddings=True) serves it)."""
    folder = make_embedding_test_model(tmp_path_factory.mktemp("emb") / "tiny-embed")
    return load_embedding_model(str(folder))


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def page_port() -> Iterator[int]:
    """The port of a static web server of tests/web: the pages the browser tests open."""
    handler = functools.partial(_QuietHandler, directory=str(WEB))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(5)


# A module whose `live` fixture is a live server (support.live.live_server: a base URL and
# the engine it serves) gets these; a module defines its own to differ.
@pytest.fixture
def url(live) -> str:
    """The module's live server's base URL."""
    return live[0]


@pytest.fixture
def engine(live):
    """The engine the module's live server serves."""
    return live[1]


@pytest.fixture
def http(url):
    """An httpx client of the module's live server (paths relative to it)."""
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


@pytest.fixture
def client(url):
    """An OpenAI client of the module's live server."""
    with openai_client(url, api_key="unused") as c:
        yield c


@pytest.fixture
def claude(url):
    """An Anthropic client of the module's live server."""
    with anthropic_client(url, api_key="unused") as c:
        yield c


@pytest.fixture
def ollama_client(url):
    """Ollama's Python client of the module's live server."""
    with ollama.Client(host=url) as c:
        yield c
