"""A third Ollama client: Simon Willison's `llm` CLI with its `llm-ollama` plugin (a venv
of their own in .test-clients, installed by `make test-deps`), against the real engine.
The plugin finds the models through /api/tags and /api/show (their capabilities), then
chats; the second run of one prompt reads its system prompt from the cache and answers
as the first did; `llm embed` goes through /api/embed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.agent_e2e import CLIENTS
from support.live import live_server
from support.ollama_e2e import SYSTEM, chat_records, tiny_dense

LLM = CLIENTS / "llm" / "bin" / "llm"
LLM_VERSION, LLM_OLLAMA_VERSION = "0.36", "0.19.1"  # the Makefile's


@pytest.fixture(scope="module")
def llm_cli() -> Path:
    if not LLM.is_file():
        pytest.skip("llm is not installed: run `make test-deps`")
    plugins = subprocess.run([str(LLM), "plugins"], capture_output=True, text=True, timeout=120)
    versions = {p["name"]: p["version"] for p in json.loads(plugins.stdout or "[]")}
    if versions.get("llm-ollama") != LLM_OLLAMA_VERSION:
        pytest.skip(f"llm-ollama {LLM_OLLAMA_VERSION} is not installed: run `make test-deps`")
    return LLM


live = live_server(tiny_dense, embeddings=True)


def run(llm: Path, url: str, home: Path, *args: str) -> str:
    env = {**os.environ, "OLLAMA_HOST": url, "LLM_USER_PATH": str(home)}
    done = subprocess.run([str(llm), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_llm_lists_chats_from_the_cache_and_embeds(llm_cli, url, tmp_path):
    models = run(llm_cli, url, tmp_path, "models", "list")
    assert "ollama/tiny-dense:latest" in models
    ask = ["-m", "ollama/tiny-dense", "-s", SYSTEM, "-o", "temperature", "0",
           "-o", "num_predict", "8", "--no-stream", "When do you close?"]  # fmt: skip
    first = run(llm_cli, url, tmp_path, *ask)
    second = run(llm_cli, url, tmp_path, *ask)
    chats = chat_records(url)
    assert len(chats) == 2 and chats[1]["cached_tokens"] > 40
    assert second == first and chats[1]["completion_tokens"] == chats[0]["completion_tokens"]
    vector = json.loads(run(llm_cli, url, tmp_path, "embed", "-m", "ollama/tiny-embed", "-c", "hi"))
    assert len(vector) == 64
