"""Prefill speed with and without the fast BLAS (issue 2, item 3), through
benchmarks/bench_blas.py: the same cold prefill of the run's first model in two child
processes, one with the mlx[cpu] wheel's reference BLAS and one with the OpenBLAS/MKL
the `mlx-prefix` launcher preloads. Not a server comparison: the rows are mlx-prefix's
(`extra["rows"]`); on macOS only the default row exists."""

from __future__ import annotations

import time

from ..harness import ServerResult
from ..models import BenchModel
from ..profiles import Sizes
from ..servers import OURS

NAME = "blas"
TITLE = "Prefill with and without the fast BLAS"
ASKED = "prefill tokens/s with and without it"


def describe(s: Sizes) -> str:
    return f"{s.blas_tokens}-token cold prefill, first model"


def run_once(sizes: Sizes, model: BenchModel) -> dict[str, ServerResult]:
    from .. import bench_blas

    res = ServerResult(OURS)
    start = time.perf_counter()
    res.extra["rows"] = bench_blas.compare(model.path, sizes.blas_tokens)
    res.extra["model"] = model.description
    res.wall_s = time.perf_counter() - start
    if len(res.extra["rows"]) < 2:
        res.notes.append("no fast BLAS to preload here (macOS uses Accelerate)")
    return {OURS: res}
