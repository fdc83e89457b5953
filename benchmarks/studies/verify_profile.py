"""Where a prompt lookup verify's time goes (issue 54): a default-mode verify forward of
L rows against a plain decode step of the lone request, at a given context, on the
default model (SmolLM2-135M-Instruct), as DecodeBatch runs them; then one layer's
attention (with the batch cache's mask array, and with none / "causal") and MLP, the
model body and the output head at 1 and 9 rows. Minimum (and median) of the repeats, in
ms, each an mx.eval of a forward whose positions are trimmed back after it.

    python -m mlx_prefix.blas_exec python benchmarks/studies/verify_profile.py [CONTEXT] [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.models.default import ensure_default_model
from mlx_prefix.models.load import load_model
from mlx_prefix.records import SamplingParams

lm = load_model(str(ensure_default_model()))
model = lm.model
CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 1700
REP = int(sys.argv[2]) if len(sys.argv) > 2 else 9
prompt = [10 + (7 * i) % 990 for i in range(CTX)]
cache = make_prompt_cache(model)
compute_chunks(model, [ChunkWork(cache, prompt, 0, len(prompt))], group=False)
mx.eval([c.state for c in cache])
batch = DecodeBatch(model, None, exact_verify=False)
batch.add(0, cache, TokenSampler(SamplingParams(temperature=0.0)), prompt[-1], steps=300)
del cache
batch.step()
C = batch.cache


def best(f, n=REP):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3, statistics.median(ts) * 1e3


def trim(L):
    for c in C:
        c.trim(L)


def step():
    batch.step()
    trim(1)
    batch._lengths = [n - 1 for n in batch._lengths]


def verify(L):
    def f():
        lg = batch.verify([batch._inputs[0]] + [11] * (L - 1))
        mx.eval(lg)
        batch._verified = None
        trim(L)
        batch._verifying = 0

    return f


inner = model.model


def body(L):
    def f():
        mx.eval(inner(mx.array([[11] * L]), cache=C))
        trim(L)

    return f


layer = inner.layers[5]


def attn(L, mask_kind):
    x = mx.random.normal((1, L, 576))
    mx.eval(x)

    def f():
        m = C[5].make_mask(L) if mask_kind == "array" else (None if L == 1 else "causal")
        mx.eval(layer.self_attn(x, m, C[5]))
        C[5].trim(L)

    return f


def mlp(L):
    x = mx.random.normal((1, L, 576))
    mx.eval(x)
    return lambda: mx.eval(layer.mlp(x))


def head(L):
    x = mx.random.normal((1, L, 576))
    mx.eval(x)
    return lambda: mx.eval(inner.embed_tokens.as_linear(x))


def fmt(t):
    return f"{t[0]:.1f} (med {t[1]:.1f})"


for _ in range(2):
    step()
    verify(9)()
s = best(step)
print(f"ctx {CTX}: decode step {fmt(s)} ms")
for L in (2, 5, 9):
    v = best(verify(L))
    print(f"  verify L={L}: {fmt(v)} ms = {v[0] / s[0]:.2f} steps (min)")
for L in (1, 9):
    attention = f"array mask {fmt(best(attn(L, 'array')))}, none/causal {fmt(best(attn(L, 'c')))}"
    print(
        f"  L={L}: body {fmt(best(body(L)))}; head {fmt(best(head(L)))}; one layer: "
        f"attention ({attention}), mlp {fmt(best(mlp(L)))}"
    )
