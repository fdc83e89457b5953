"""The embedding model (mlx-lm's classes, backbone only), its pooling, the batch plan and
the worker thread, checked against a direct forward pass of the same weights."""

from __future__ import annotations

import importlib
import json
import threading
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_prefix.embeddings.batches import plan_batches
from mlx_prefix.embeddings.model import (
    Pooling,
    load_embedding_model,
    read_pooling,
    truncate,
)
from mlx_prefix.embeddings.testing import make_embedding_test_model
from mlx_prefix.embeddings.worker import EmbeddingWorker
from mlx_prefix.errors import EngineBusy, ModelNotFound

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void.",
    "Light",
    "And God said, Let there be light: and there was light. And God saw the light, that "
    "it was good: and God divided the light from the darkness.",
]
TOL = {"rtol": 1e-4, "atol": 1e-5}  # batched rows may round differently, never by more


def direct_vectors(folder: Path, rows: list[list[int]], mode: str, normalize: bool):
    """Each row alone through mlx-lm's qwen3 Model built by hand from the folder's bare
    backbone weights, pooled and normalised in numpy: no code of the server's."""
    config = json.loads((folder / "config.json").read_text())
    module = importlib.import_module("mlx_lm.models.qwen3")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = mx.load(str(folder / "model.safetensors"))
    model.load_weights([(f"model.{k}", v) for k, v in weights.items()], strict=True)
    out = []
    for ids in rows:
        h = np.array(model.model(mx.array(ids)[None]).astype(mx.float32))[0]  # [L, D]
        v = {"lasttoken": h[-1], "cls": h[0], "mean": h.mean(axis=0)}[mode]
        out.append(v / np.linalg.norm(v) if normalize else v)
    return np.stack(out)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_embedding_test_model(tmp_path_factory.mktemp("emb") / "tiny-embed")


@pytest.fixture(scope="module")
def model(folder):
    return load_embedding_model(str(folder))


def test_loads_the_bare_backbone_with_its_pooling(model, folder):
    assert model.name == "tiny-embed" and model.path == folder.resolve()
    assert model.pooling == Pooling("lasttoken", True, True, ())
    assert model.dimensions == 64 and model.dtype == "float32"
    assert "lm_head" not in model.model
    n = sum(v.size for v in mx.load(str(folder / "model.safetensors")).values())
    assert model.weights_bytes == 4 * n


def test_batched_vectors_equal_the_direct_forward_pass(model, folder):
    rows = model.tokenize(TEXTS)
    assert len({len(r) for r in rows}) == len(rows)  # padding is exercised
    got = model.embed(rows)
    want = direct_vectors(folder, rows, "lasttoken", True)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_long_rows_in_chunks_equal_one_pass(model, folder):
    rows = model.tokenize(TEXTS)
    np.testing.assert_allclose(model.embed(rows, chunk=5), model.embed(rows), **TOL)


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_other_poolings_unnormalised(tmp_path, mode):
    folder = make_embedding_test_model(tmp_path / mode, pooling=mode, normalize=False)
    m = load_embedding_model(str(folder))
    assert m.pooling.mode == mode and not m.pooling.normalize
    rows = m.tokenize(TEXTS)
    got = m.embed(rows, chunk=7)  # mean sums across chunks; cls only reads the first
    np.testing.assert_allclose(got, direct_vectors(folder, rows, mode, False), **TOL)


def test_matryoshka_truncation_renormalises(model):
    full = model.embed(model.tokenize(TEXTS[:2]))
    short = truncate(full, 16, normalize=True)
    assert short.shape == (2, 16)
    np.testing.assert_allclose(short, full[:, :16] / np.linalg.norm(full[:, :16], axis=1)[:, None])
    assert model.allowed_dimensions(16) and model.allowed_dimensions(64)
    assert not model.allowed_dimensions(65) and not model.allowed_dimensions(0)
    plain = replace(model, pooling=replace(model.pooling, matryoshka=False))
    assert plain.allowed_dimensions(64) and not plain.allowed_dimensions(16)
    listed = replace(model, pooling=replace(model.pooling, matryoshka_dimensions=(16, 32)))
    assert listed.allowed_dimensions(32) and not listed.allowed_dimensions(24)


def test_pooling_files_read_or_refused(tmp_path):
    folder = make_embedding_test_model(tmp_path / "m", matryoshka=False)
    assert read_pooling(folder) == Pooling("lasttoken", True, False, ())
    assert read_pooling(folder, matryoshka=True).matryoshka
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (folder / "config.json").write_text(json.dumps(config))
    assert read_pooling(folder).matryoshka_dimensions == (16, 32)

    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (folder / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(ValueError, match="Dense not supported"):
        read_pooling(folder)
    with pytest.raises(ModelNotFound, match="Dense not supported") as e:
        load_embedding_model(str(folder))
    assert e.value.param == "embedding_model"

    (folder / "modules.json").write_text(json.dumps(modules))
    pool = folder / "1_Pooling" / "config.json"
    pool.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling max_tokens not supported"):
        read_pooling(folder)

    (folder / "modules.json").unlink()  # a decoder without the files: last token, unit
    assert read_pooling(folder) == Pooling("lasttoken", True, True, (16, 32))


def test_an_encoder_mlx_lm_cannot_load_is_refused_in_one_line(tmp_path, folder):
    bert = tmp_path / "bert"
    bert.mkdir()
    for f in folder.iterdir():
        if f.is_file():
            (bert / f.name).write_bytes(f.read_bytes())
    (bert / "modules.json").unlink()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    with pytest.raises(ModelNotFound, match="could not be loaded: .*bert") as e:
        load_embedding_model(str(bert))
    assert "\n" not in e.value.message


def test_plan_batches_covers_every_row_within_the_budget():
    lengths = [5, 300, 7, 7, 100, 1, 2000, 64, 3]
    plan = plan_batches(lengths, max_tokens=512, max_rows=3)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for batch in plan:
        width = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * width <= 512
        assert len(batch) <= 3
        assert all(2 * lengths[i] >= width for i in batch)  # at most half padding
    assert [6] in plan  # longer than the budget: alone
    assert plan_batches([10, 9, 4, 3]) == [[0, 1], [2, 3]]


class _Gate:
    """A stand-in model whose embed waits for a signal: the worker is held mid-batch."""

    dimensions = 2

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[list[int]]] = []

    def embed(self, rows):
        self.batches.append(rows)
        self.entered.set()
        assert self.release.wait(10)
        return np.array([[len(r), r[0]] for r in rows], dtype=np.float32)


def test_worker_batches_waiting_requests_together_and_bounds_the_queue():
    gate = _Gate()
    worker = EmbeddingWorker(gate, max_queued=3)  # type: ignore[arg-type]
    try:
        first = worker.submit([[1, 2, 3]])
        assert gate.entered.wait(10)  # the worker holds `first`; the next ones wait
        a = worker.submit([[4], [5, 6]])
        b = worker.submit([[7, 8]])
        gone = worker.submit([[9, 9, 9, 9]])
        with pytest.raises(EngineBusy):
            worker.submit([[10]])
        assert gone.cancel()  # its client left before its turn
        gate.release.set()
        np.testing.assert_array_equal(first.result(10), [[3, 1]])
        np.testing.assert_array_equal(a.result(10), [[1, 4], [2, 5]])
        np.testing.assert_array_equal(b.result(10), [[2, 7]])
    finally:
        worker.close()
    # `a` and `b` shared one padded forward, longest first; `gone` was never computed.
    assert gate.batches == [[[1, 2, 3]], [[5, 6], [7, 8], [4]]]
    assert worker.stats.requests == 3 and worker.stats.forwards == 2


def test_worker_gives_each_request_the_failure():
    class Broken:
        dimensions = 2

        def embed(self, rows):
            raise RuntimeError("boom")

    worker = EmbeddingWorker(Broken())  # type: ignore[arg-type]
    try:
        with pytest.raises(Exception, match="embedding failed: RuntimeError: boom"):
            worker.submit([[1]]).result(10)
    finally:
        worker.close()
