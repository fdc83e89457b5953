"""Could several requests' prefill rows share one matmul and stay exact on this machine?

That is the one thing mlx_lm.server's batched prefill does that mlx-prefix does not
(issue 15): it puts every request's chunk in one forward [B, L], so each linear layer
projects B x L rows in one matmul. mlx-prefix projects each request's rows in their own
matmul (engine/forward/rowwise.py), because with a real BLAS a row's result can depend on how
many rows share the call. Two measurements, on one model:

1. rows: for each linear layer shape, a request's chunk projected in its own matmul (its
   cold prefill) against the same rows inside one matmul with other requests' chunks,
   placed first and last: as they come, and with every request's rows (its own matmul's
   too) padded to a 64-row block, so that each row sits at the same place in the BLAS's
   row tiles either way. A case counts as equal only if every row of the chunk is equal
   bit for bit.
2. cost: B sequences of L tokens as one plain forward (mlx_lm's batch, not exact), one
   forward each (mlx-prefix's cold prefill), and one stacked forward with each sequence's
   projections in their own matmul (exact): what exactness costs per token.

Run it with the fast BLAS, on the machine in question:
`python -m mlx_prefix.blas_exec python -m benchmarks.bench_prefill_rows [--model hybrid]`.
Where every case of every shape is equal, sharing the matmul could be made exact (behind
the startup probe); with OpenBLAS on this Linux CPU it is not (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.models import resolve
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.models.load import load_model

# (the request's chunk length, the other requests' chunk lengths)
CASES = ((40, (45, 38, 51, 40, 47)), (150, (160, 140)), (256, (256,)), (7, (300,)), (300, (7,)))
BLOCK = 64  # the padded layout: each request's rows start on a multiple of this


def _padded(x: mx.array, block: int) -> mx.array:
    extra = -x.shape[0] % block
    return mx.concatenate([x, mx.zeros((extra, x.shape[1]), x.dtype)]) if extra else x


def rows_equal(layer: nn.Module, mine: int, others: tuple[int, ...], block: int) -> list[bool]:
    """Whether `mine` rows projected inside one matmul with `others` rows equal their own
    matmul's, with the chunk placed first and then last; every request padded to a
    multiple of `block` rows, its own matmul included (1: as they come)."""
    project = rowwise.own_projection(layer)
    dims = rowwise.input_width(layer)
    dtype = layer.scales.dtype if hasattr(layer, "scales") else layer.weight.dtype
    chunks = [
        mx.random.normal((n, dims), dtype, key=mx.random.key(i))
        for i, n in enumerate((mine, *others))
    ]  # the layer's own dtype: a bfloat16 model on Metal is measured in bfloat16
    blocks = [_padded(c, block) for c in chunks]
    alone = project(blocks[0])[:mine]
    first = project(mx.concatenate(blocks))[:mine]
    after = sum(b.shape[0] for b in blocks[1:])
    last = project(mx.concatenate(blocks[1:] + blocks[:1]))[after : after + mine]
    mx.eval(alone, first, last)
    return [mx.array_equal(first, alone).item(), mx.array_equal(last, alone).item()]


def rows_table(model: nn.Module) -> list[dict]:
    table = []
    for (kind, shape), layer in rowwise.layer_shapes(model).items():
        row = {"layer": kind.__name__, "inputs": rowwise.input_width(layer), "outputs": shape[0]}
        row["cases"] = 2 * len(CASES)
        for name, block in (("as_they_come", 1), ("padded", BLOCK)):
            row[name] = sum(sum(rows_equal(layer, m, o, block)) for m, o in CASES)
        table.append(row)
    return table


def _seconds(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cost_row(model: nn.Module, batch: int, length: int, repeats: int) -> dict:
    prompts = [[10 + (7 * k + 3 * b) % 900 for k in range(length)] for b in range(batch)]

    def plain() -> None:
        cache = make_prompt_cache(model)
        out = model(mx.array(prompts), cache=cache)
        mx.eval(out[:, -1], [c.state for c in cache])

    def chunks(group: bool):
        def run() -> None:
            works = [ChunkWork(make_prompt_cache(model), p, 0, length) for p in prompts]
            compute_chunks(model, works, group=group)

        return run

    row = {"batch": batch, "length": length}
    for name, run in (("one_forward", plain), ("alone", chunks(False)), ("stacked", chunks(True))):
        row[name + "_s"] = _seconds(run, repeats)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dense", help="'dense', 'hybrid' or a model folder")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--lengths", default="40,150", help="comma-separated chunk lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/prefill_rows.json"))
    args = parser.parse_args(argv)

    loaded = load_model(str(resolve(args.model).path))
    rowwise.install(loaded.model)  # outside `batched` the layers compute as before
    table = rows_table(loaded.model)
    print(f"{loaded.name}: a chunk's rows inside one matmul with others' equal to its own")
    print(f"{'layer':<18}{'shape':>14}{'as they come':>14}{'padded':>10}")
    for r in table:
        shape = f"{r['inputs']}->{r['outputs']}"
        came, padded = f"{r['as_they_come']}/{r['cases']}", f"{r['padded']}/{r['cases']}"
        print(f"{r['layer']:<18}{shape:>14}{came:>14}{padded:>10}")
    costs = [
        cost_row(loaded.model, args.batch, int(n), args.repeats) for n in args.lengths.split(",")
    ]
    print(f"\n{args.batch} sequences, median of {args.repeats}: seconds")
    print(f"{'tokens each':<12}{'one forward':>13}{'one each':>10}{'stacked':>9}")
    for c in costs:
        print(
            f"{c['length']:<12}{c['one_forward_s']:>13.3f}{c['alone_s']:>10.3f}"
            f"{c['stacked_s']:>9.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"model": loaded.name, "rows": table, "cost": costs}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
