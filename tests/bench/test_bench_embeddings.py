"""benchmarks/studies/embeddings.py end to end on a tiny model: it starts mlx-prefix with the
embedding model, measures it beside a peer (here a second, in-process server on the same
folder), checks the two agree, and writes its JSON. No timing assertions."""

from __future__ import annotations

import json

from support.server_fakes import FakeEngine, LiveServer

from benchmarks.studies.embeddings import main
from mlx_prefix.embeddings.model import load_embedding_model
from mlx_prefix.embeddings.testing import make_embedding_test_model
from mlx_prefix.embeddings.worker import EmbeddingWorker
from mlx_prefix.server import ServerSettings, create_app


def test_bench_measures_both_servers_and_their_agreement(tmp_path, capsys):
    folder = make_embedding_test_model(tmp_path / "tiny-embed")
    worker = EmbeddingWorker(load_embedding_model(str(folder)))
    app = create_app(FakeEngine(), ServerSettings(), embeddings=worker)
    out = tmp_path / "cells.json"
    try:
        with LiveServer(app) as peer:
            argv = ["--embedding-model", str(folder), "--peer-url", peer.url, "--inputs", "4",
                    "--batch", "1,2", "--concurrency", "2", "--check",
                    "--out", str(out)]  # fmt: skip
            assert main(argv) == 0
    finally:
        worker.close()
    doc = json.loads(out.read_text())
    cells = doc["cells"]
    assert len(cells) == 2 * 2 * 2  # workloads x batch sizes x servers
    assert {c["server"] for c in cells} == {"mlx-prefix", "peer"}
    assert all(c["inputs"] == 4 and c["tokens"] > 0 and c["inputs_per_s"] > 0 for c in cells)
    assert all(cos > 0.9999 for cos in doc["agreement"].values())
    assert "| mlx-prefix | long | 2 | 2 |" in capsys.readouterr().out
