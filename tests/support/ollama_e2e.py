"""What the end-to-end tests of Ollama's clients share: the real engine on the tiny dense
model with a tiny embedding model beside it, and the server's record of its requests
(from which a run's cache reads are read, whatever the client reports)."""

from __future__ import annotations

import httpx

from mlx_prefix.engine.engine import Engine
from support.models import TEST_CACHE, loaded_test_model

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4


def tiny_dense() -> Engine:
    """The real engine on tiny-dense: a module's `live_server(tiny_dense, embeddings=True)`
    serves it with the tiny embedding model `tiny-embed` beside it."""
    return Engine(loaded_test_model("dense"), TEST_CACHE)


def chat_records(url: str) -> list[dict]:
    """The server's records of the /api/chat requests it answered (the dashboard's)."""
    records = httpx.get(url + "/v1/dashboard").json()["requests"]
    return [r for r in records if r["endpoint"] == "/api/chat" and r["status"] == "200"]
