"""Row-wise projections: in a stacked forward [B, L], each sequence's rows go through
every linear layer in their own matmul, exactly the call that sequence makes alone.

Why: with a real BLAS a matmul row's result depends on how many rows share the call
(measured with OpenBLAS: its micro-kernels and thread split treat the tail rows of a
call differently, so row 0 of a 24-row call differs from row 0 of a 1100-row call by
~1e-6; on Metal the kernel itself is chosen by M: gemv, split-K, tiled GEMM). Stacking
two requests' chunks into one [2L, K] GEMM therefore changes both requests' numbers.
Everything else in a forward (norms, RoPE, attention over equal-length caches,
convolutions, recurrent scans) computes each batch row on its own, so a stacked forward
whose projections run per sequence reproduces each sequence's alone run bit for bit
(docs/ARCHITECTURE.md, "Why batched prefill is exact"; the engine's startup probe checks
it on the loaded model).

The model's linear and embedding modules get a subclass that behaves exactly as before
unless row-wise mode is on in the calling thread (`rowwise()`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

_mode = threading.local()


def _active() -> bool:
    return getattr(_mode, "on", False)


@contextmanager
def rowwise() -> Iterator[None]:
    """Row-wise projections for forwards built in this thread inside the block."""
    before = _active()
    _mode.on = True
    try:
        yield
    finally:
        _mode.on = before


def _split_call(base_call):
    def __call__(self, x: mx.array) -> mx.array:
        if _active() and x.ndim >= 3 and x.shape[0] > 1:
            return mx.concatenate([base_call(self, x[i : i + 1]) for i in range(x.shape[0])])
        return base_call(self, x)

    return __call__


def _split_as_linear(base_as_linear):
    def as_linear(self, x: mx.array) -> mx.array:
        if _active() and x.ndim >= 3 and x.shape[0] > 1:
            return mx.concatenate([base_as_linear(self, x[i : i + 1]) for i in range(x.shape[0])])
        return base_as_linear(self, x)

    return as_linear


_subclasses: dict[type, type] = {}


def _rowwise_class(cls: type) -> type:
    if cls not in _subclasses:
        namespace: dict = {"_rowwise_base": cls}
        if issubclass(cls, (nn.Linear, nn.QuantizedLinear)):
            namespace["__call__"] = _split_call(cls.__call__)
        else:
            namespace["as_linear"] = _split_as_linear(cls.as_linear)
        _subclasses[cls] = type(f"RowWise{cls.__name__}", (cls,), namespace)
    return _subclasses[cls]


_TARGETS = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)


def install(model: nn.Module) -> int:
    """Give the model's linear and embedding layers row-wise behaviour (idempotent).
    Returns how many modules were changed."""
    changed = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls in _TARGETS:
            module.__class__ = _rowwise_class(cls)
            changed += 1
    return changed
