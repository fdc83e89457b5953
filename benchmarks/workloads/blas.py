"""Prefill speed with and without the fast BLAS the `mlx-prefix` launcher preloads
(workload `blas`, once per run): the same cold prefill (default: the bundled SmolLM2-135M,
float32; in a run, the run's first model) in two child processes, one with MLX's bundled
reference BLAS (the mlx[cpu] wheel's on Linux) and one with the preloaded OpenBLAS/MKL.
Not a server comparison: the rows are mlx-prefix's (`extra["rows"]`); on macOS only the
default row exists. On its own, it prints tokens/s for each:

    python -m benchmarks.workloads.blas [--tokens 512] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mlx_prefix.blas_exec import fast_blas_env
from mlx_prefix.platform import PRELOADED_ENV

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
    res = ServerResult(OURS)
    start = time.perf_counter()
    res.extra["rows"] = compare(model.path, sizes.blas_tokens)
    res.extra["model"] = model.description
    res.wall_s = time.perf_counter() - start
    if len(res.extra["rows"]) < 2:
        res.notes.append("no fast BLAS to preload here (macOS uses Accelerate)")
    return {OURS: res}


CHILD = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_prefix.models.load import load_model
from mlx_prefix.platform import loaded_blas
from mlx_prefix.prompt.request.grid import ChunkGrid
from mlx_prefix.engine.forward.runner import prefill

n, spec = int(sys.argv[1]), (sys.argv[2] or None)
loaded = load_model(spec)
tokens = [(i * 7919) % 40000 + 100 for i in range(n)]
grid = ChunkGrid(256)
prefill(loaded.model, make_prompt_cache(loaded.model), tokens[:16], 0, grid, lambda p: 0)
start = time.perf_counter()
mx.eval(prefill(loaded.model, make_prompt_cache(loaded.model), tokens, 0, grid, lambda p: 0))
seconds = time.perf_counter() - start
row = {"blas": loaded_blas(), "tokens": n, "seconds": seconds, "tokens_per_s": n / seconds}
print(json.dumps(row))
"""


def prefill_in_child(env: dict[str, str], tokens: int, model: str | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tokens), model or ""],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=3600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(model: str | Path | None, tokens: int) -> list[dict]:
    """One row per BLAS: the process's default one, then the fast one where there is one
    to preload. Whatever this process has preloaded, the first child runs without it."""
    plain = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", PRELOADED_ENV)}
    spec = None if model is None else str(model)
    rows = [prefill_in_child(plain, tokens, spec)]
    fast = fast_blas_env(plain)
    if PRELOADED_ENV in fast:
        rows.append(prefill_in_child(fast, tokens, spec))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/blas.json"))
    args = parser.parse_args()
    rows = compare(args.model, args.tokens)
    if len(rows) < 2:
        print("no fast BLAS found to preload (macOS, or none installed)", file=sys.stderr)
    for row in rows:
        print(
            f"{row['blas']:<10} {row['tokens']} tokens  {row['seconds']:8.2f} s  "
            f"{row['tokens_per_s']:8.1f} tok/s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
