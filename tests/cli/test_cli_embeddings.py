"""`mlx-prefix serve --embedding-model`: the flags, and the real server process serving
/v1/embeddings beside the chat model, its startup line, and its shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from support.live import openai_client
from support.served_process import StderrReader, serve_process

from mlx_prefix.cli import build_parser
from mlx_prefix.cli.serve import embedding_worker
from mlx_prefix.cli.serve_args import server_settings
from mlx_prefix.embeddings.testing import make_embedding_test_model
from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.testing import cached_test_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_embedding_test_model(tmp_path_factory.mktemp("emb") / "tiny-embed")


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--model", str(cached_test_model("dense")), *flags])


def test_flags_and_env(folder, monkeypatch):
    assert embedding_worker(serve_args()) is None
    args = serve_args("--embedding-model", str(folder), "--embedding-alias", "e3",
                      "--embedding-alias", "e4")  # fmt: skip
    assert server_settings(args).embedding_aliases == ("e3", "e4")
    monkeypatch.setenv("MLX_PREFIX_MODEL_EMBEDDING_MODEL", str(folder))
    worker = embedding_worker(serve_args())
    try:
        assert worker.model.name == "tiny-embed"
    finally:
        worker.close()
    with pytest.raises(ModelNotFound, match="not found: no such folder"):
        embedding_worker(serve_args("--embedding-model", "./missing"))


def test_serve_answers_embeddings_beside_chat(folder, tmp_path):
    cmd = [sys.executable, "-m", "mlx_prefix", "serve", "--model", str(cached_test_model("dense")),
           "--embedding-model", str(folder), "--embedding-alias", "e3", "--port", "0",
           "--disk-cache", "off", "--no-prefetch"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with serve_process(cmd, env=env, stdout=subprocess.DEVNULL) as proc:
        err = StderrReader(proc)
        url = f"http://127.0.0.1:{err.port(timeout=300)}"
        httpx.get(url + "/health", timeout=30).raise_for_status()
        with openai_client(url) as client:
            r = client.embeddings.create(model="e3", input=["a", "b c"], dimensions=8)
            assert r.model == "tiny-embed" and [len(d.embedding) for d in r.data] == [8, 8]
            chat = client.chat.completions.create(
                model="tiny-dense", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.choices[0].message.content is not None
    log = err.text()
    assert "embeddings: tiny-embed (64 dimensions, lasttoken pooling, normalised" in log
    assert proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
