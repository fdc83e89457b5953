"""The official `ollama` npm package (installed into .test-clients by `make test-deps`),
run by Node against the real engine: list, show, chat (whole and streamed), generate,
embed, ps and an error, with the second chat served from the cache and answering as a
cold run does (tests/e2e/ollama_js_client.cjs drives it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from support.agent_e2e import OFFLINE, npm_package
from support.live import live_server
from support.ollama_e2e import SYSTEM, chat_records, tiny_dense

OLLAMA_JS_VERSION = "0.6.4"  # the Makefile's OLLAMA_JS_VERSION
SCRIPT = Path(__file__).parent / "ollama_js_client.cjs"


@pytest.fixture(scope="module")
def package() -> Path:
    folder, why = npm_package("ollama", OLLAMA_JS_VERSION)
    if folder is None:
        pytest.skip(why)
    if shutil.which("node") is None:
        pytest.skip("no node on PATH: the ollama npm package needs Node")
    return folder


live = live_server(tiny_dense, embeddings=True)


def test_the_npm_client_chats_streams_lists_and_reads_its_second_prompt_from_the_cache(
    package, url
):
    env = {**os.environ, **OFFLINE}
    done = subprocess.run(
        ["node", str(SCRIPT), str(package), url, "tiny-dense:latest", "tiny-embed"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    first, second, streamed = chat_records(url)[:3]
    assert first["cached_tokens"] < second["cached_tokens"] and second["cached_tokens"] > 40
    cold = httpx.post(url + "/api/chat", timeout=120, json={
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
