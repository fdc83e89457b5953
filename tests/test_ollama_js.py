"""The official `ollama` npm package (installed into .test-clients by `make test-deps`),
run by Node against the real engine: list, show, chat (whole and streamed), generate,
embed, ps and an error, with the second chat served from the cache and answering as a
cold run does (tests/ollama_js_client.cjs drives it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from agent_e2e import OFFLINE, npm_package
from conftest import TEST_CACHE, loaded_test_model
from server_fakes import LiveServer

from mlx_prefix.embeddings.model import load_embedding_model
from mlx_prefix.embeddings.testing import make_embedding_test_model
from mlx_prefix.embeddings.worker import EmbeddingWorker
from mlx_prefix.engine.engine import Engine
from mlx_prefix.server import ServerSettings, create_app

OLLAMA_JS_VERSION = "0.6.4"  # the Makefile's OLLAMA_JS_VERSION
SCRIPT = Path(__file__).parent / "ollama_js_client.cjs"
SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4


@pytest.fixture(scope="module")
def package() -> Path:
    folder, why = npm_package("ollama", OLLAMA_JS_VERSION)
    if folder is None:
        pytest.skip(why)
    if shutil.which("node") is None:
        pytest.skip("no node on PATH: the ollama npm package needs Node")
    return folder


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[str]:
    folder = make_embedding_test_model(tmp_path_factory.mktemp("emb") / "tiny-embed")
    worker = EmbeddingWorker(load_embedding_model(str(folder)))
    engine = Engine(loaded_test_model("dense"), TEST_CACHE)
    try:
        with LiveServer(create_app(engine, ServerSettings(), embeddings=worker)) as server:
            yield server.url
    finally:
        engine.shutdown()
        worker.close()


def test_the_npm_client_chats_streams_lists_and_reads_its_second_prompt_from_the_cache(
    package, live
):
    env = {**os.environ, **OFFLINE}
    done = subprocess.run(
        ["node", str(SCRIPT), str(package), live, "tiny-dense:latest", "tiny-embed"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    records = httpx.get(live + "/v1/dashboard").json()["requests"]
    chats = [r for r in records if r["endpoint"] == "/api/chat" and r["status"] == "200"]
    first, second, streamed = chats[:3]
    assert first["cached_tokens"] < second["cached_tokens"] and second["cached_tokens"] > 40
    cold = httpx.post(live + "/api/chat", timeout=120, json={
        "model": "tiny-dense", "stream": False, "options": {"temperature": 0, "num_predict": 8},
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "When do you close?"}],
        "prefix_cache": {"enabled": False},
    }).json()  # fmt: skip
    assert cold["prompt_eval_cached_count"] == 0
    assert out["second"]["message"]["content"] == cold["message"]["content"]
    assert out["streamed"] == out["generated"] == cold["message"]["content"]
    assert out["final"]["done"] and out["final"]["prompt_eval_count"] == cold["prompt_eval_count"]
    assert out["models"] == ["tiny-dense:latest", "tiny-embed:latest"]
    assert out["capabilities"] == ["completion"] and out["version"]
    assert len(out["embeddings"]) == 2 and out["running"][0] == "tiny-dense:latest"
    assert out["error"]["name"] == "ResponseError" and out["error"]["status"] == 400
    assert "format" in out["error"]["message"]
