"""What the end-to-end tests of Ollama's clients share: the real engine on the tiny dense
model with a tiny embedding model beside it, and the server's record of its requests
(from which a run's cache reads are read, whatever the client reports)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx

from mlx_prefix.embeddings.model import load_embedding_model
from mlx_prefix.embeddings.testing import make_embedding_test_model
from mlx_prefix.embeddings.worker import EmbeddingWorker
from mlx_prefix.engine.engine import Engine
from mlx_prefix.server import ServerSettings, create_app
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import LiveServer

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4


@contextlib.contextmanager
def real_server(folder: Path) -> Iterator[str]:
    """The real engine on tiny-dense and the embedding model `tiny-embed` (made in
    `folder`) behind a live server: yields its URL."""
    model = make_embedding_test_model(folder / "tiny-embed")
    worker = EmbeddingWorker(load_embedding_model(str(model)))
    engine = Engine(loaded_test_model("dense"), TEST_CACHE)
    try:
        with LiveServer(create_app(engine, ServerSettings(), embeddings=worker)) as server:
            yield server.url
    finally:
        engine.shutdown()
        worker.close()


def chat_records(url: str) -> list[dict]:
    """The server's records of the /api/chat requests it answered (the dashboard's)."""
    records = httpx.get(url + "/v1/dashboard").json()["requests"]
    return [r for r in records if r["endpoint"] == "/api/chat" and r["status"] == "200"]
