"""benchmarks/bench_prefill_rows.py on a tiny model: its exactness check says equal for a
chunk with nothing beside it and for rows the shared call cannot disturb, and the run
writes one row per layer shape and the three timings. No timing or BLAS assertions: what
this machine's BLAS does is what the script measures."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from benchmarks.bench_prefill_rows import CASES, main, rows_equal
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model


def test_a_chunk_alone_in_the_shared_call_is_equal() -> None:
    layer = nn.Linear(64, 32)
    mx.eval(layer.parameters())
    assert rows_equal(layer, 40, (), 1) == [True, True]
    assert rows_equal(layer, 40, (), 64) == [True, True]


def test_a_wrong_projection_is_caught() -> None:
    # Different weights for the shared call than for the chunk's own: never equal.
    class Drifting(nn.Linear):
        calls = 0

        def __call__(self, x: mx.array) -> mx.array:
            Drifting.calls += 1
            return super().__call__(x) + (Drifting.calls > 1)

    layer = Drifting(64, 32)
    assert rows_equal(layer, 40, (45,), 1) == [False, False]


def test_run_writes_every_layer_shape_and_the_timings(tmp_path: Path) -> None:
    model = cached_test_model("dense")
    out = tmp_path / "rows.json"
    main(["--model", str(model), "--lengths", "8", "--batch", "2", "--repeats", "1",
          "--out", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    loaded = load_model(str(model))
    assert len(doc["rows"]) == len(rowwise.layer_shapes(loaded.model))
    for row in doc["rows"]:
        assert row["cases"] == 2 * len(CASES)
        assert 0 <= row["as_they_come"] <= row["cases"] and 0 <= row["padded"] <= row["cases"]
    (cost,) = doc["cost"]
    assert cost["batch"] == 2 and cost["length"] == 8
    assert all(cost[k] > 0 for k in ("one_forward_s", "alone_s", "stacked_s"))
