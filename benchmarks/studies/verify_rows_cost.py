"""What a verify of several requests costs (issue 54): on the default model, B requests at
a given context decoding together, a plain batched step against one `DecodeBatch`
verify of rows of given widths (a row's input and its drafted tokens), with a shorter
row's padding skipped (as served) and computed (every row padded to the widest: the
model's own [B, L] forward, as before), then the settle after it: every row but one
kept only its input, so those rows end 8 positions early (`keep_rows`: the long row
moved left where it has the room, else the others right; mlx-lm's right-padding roll
beside it). Medians of the repeats, in ms, each an mx.eval.

    python -m mlx_prefix.blas_exec python benchmarks/studies/verify_rows_cost.py \
        [CONTEXT] [B] [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlx_prefix.cache.layers.rewind import keep_rows
from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.models.default import ensure_default_model
from mlx_prefix.models.load import load_model
from mlx_prefix.records import SamplingParams

CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
B = int(sys.argv[2]) if len(sys.argv) > 2 else 4
REP = int(sys.argv[3]) if len(sys.argv) > 3 else 15
model = load_model(str(ensure_default_model())).model
batch = DecodeBatch(model, None, exact_verify=False)
for b in range(B):
    prompt = [10 + (7 * i + b) % 990 for i in range(CTX + 13 * b)]  # left padding differs
    cache = make_prompt_cache(model)
    compute_chunks(model, [ChunkWork(cache, prompt, 0, len(prompt))], group=False)
    mx.eval([c.state for c in cache])
    batch.add(b, cache, TokenSampler(SamplingParams(temperature=0.0)), prompt[-1], steps=300)
batch.step()
if batch.launched:
    batch.read_launched()
rowwise.install(model)  # as engine/decode/verify_rows.py does before a verify of several


def median_ms(f) -> float:
    times = []
    for _ in range(REP):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def trim(n: int) -> None:
    for c in batch.cache:
        c.trim(n)


def step() -> None:
    batch.step()
    if batch.launched:
        batch.read_launched()
    trim(1)
    batch._lengths = [n - 1 for n in batch._lengths]


def verify(widths: list[int], padded: bool):
    width = max(widths)

    def f() -> None:
        rows = [[batch._inputs[i]] + [11] * (w - 1) for i, w in enumerate(widths)]
        if padded:
            rows = [row + [row[-1]] * (width - len(row)) for row in rows]
        mx.eval(batch.verify_rows(rows))
        trim(width)
        batch._verifying = 0

    return f


def settle(roll: bool, long: int = 0):
    """The settle after a verify where row `long` drafted 8 tokens and kept them, the
    others none: row 0 has room to move left (the most left padding), the last none."""

    def f() -> None:
        layers = [c for c in batch.cache if isinstance(c, BatchKVCache)]
        saved = [(c.keys, c.values, c.offset, c.left_padding, c._idx) for c in layers]
        kept = [9 if i == long else 1 for i in range(B)]
        rows = [[t, *[11] * (n - 1)] for t, n in zip(batch._inputs, kept, strict=True)]
        mx.eval(batch.verify_rows(rows))
        batch._verifying = 0
        start = time.perf_counter()
        if roll:  # mlx-lm's own: every row to the most kept, by a roll of the whole buffer
            for c in layers:
                c.prepare(right_padding=[9 - n for n in kept])
                c.finalize()
        else:
            keep_rows(batch.cache, 9, kept)
        mx.eval([(c.keys, c.values) for c in layers])
        times.append(time.perf_counter() - start)
        # Its layout back (the numbers moved stay moved: only the timings matter here).
        for c, (k, v, o, p, i) in zip(layers, saved, strict=True):
            c.keys, c.values, c.offset, c.left_padding, c._idx = k, v, o, p, i

    times: list[float] = []
    for _ in range(REP):
        f()
    return statistics.median(times) * 1e3


for _ in range(2):
    step()
    verify([9] + [1] * (B - 1), False)()
plain = median_ms(step)
print(f"B={B}, {CTX} tokens of context: a plain step {plain:.0f} ms")
for widths in (
    [2] + [1] * (B - 1),
    [5] + [1] * (B - 1),
    [9] + [1] * (B - 1),
    [9, 9] + [1] * (B - 2),
    [9] * B,
):
    skipped, computed = median_ms(verify(widths, False)), median_ms(verify(widths, True))
    print(
        f"  widths {widths}: padding skipped {skipped:.0f} ms = {skipped / plain:.2f} steps; "
        f"computed {computed:.0f} ms = {computed / plain:.2f} steps"
    )
moved, rolled = settle(False), settle(True)
print(f"  settle after widths [9, 1, ...]: keep_rows {moved:.0f} ms, mlx-lm's roll {rolled:.0f} ms")
print(f"  settle after widths [..., 1, 9], no room: keep_rows {settle(False, B - 1):.0f} ms")
