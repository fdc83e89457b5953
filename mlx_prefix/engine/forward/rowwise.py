"""Batch-invariant forwards: in a batched forward every sequence gets the numbers of its
alone run, bit for bit.

Two things in a transformer forward depend, with a real BLAS, on what else shares the
call (measured with OpenBLAS on this CPU; docs/ARCHITECTURE.md):
- a matmul row's result depends on how many rows the call has: the BLAS computes tail
  rows with other micro-kernels and splits rows between threads by count (row 0 of a
  24-row call differs from row 0 of a 1100-row call by ~1e-6; on Metal the kernel
  itself is chosen by M: gemv, split-K, tiled GEMM);
- attention's reductions over keys depend on how many keys the call has: a left-padded
  row of a decode batch attends over the longest row's key count, and the BLAS blocks
  that reduction differently (diverged after ~20 steps at 300 keys on SmolLM2).
So inside `batched(...)` the model's linear layers project each sequence's rows in their
own matmul (stacked prefill chunks), or decode rows in groups no larger than the BLAS
computes like that row alone for the layer's shape (`measure_rows`): on this CPU 12 rows
as the matmul's rows for the wide projections and the output head, which hold nearly all
the weight bytes a decode step reads, 3 for narrow ones such as a 128-wide value
projection; past that a float layer takes the rows as the matmul's columns (W @ X^T),
which the BLAS keeps apart for up to 30 of them here, each still equal to the row alone
as rows (so neither the form nor the group changes a number), and attention runs per row
over exactly that row's keys. Everything else (norms, RoPE, convolutions, recurrent
scans) computes each batch row on its own. Outside the block the modules behave exactly
as before.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

from mlx_prefix.engine.forward import stepwise
from mlx_prefix.engine.forward import verify_positions as positions


class Grouping(NamedTuple):
    """How many decode rows one call of a linear layer may project and still compute
    each exactly like the layer called on that row alone (`measure_rows`)."""

    as_rows: int  # as the matmul's rows, its own call (at least 1)
    as_columns: int = 0  # as its columns, W @ X^T (float layers; 0: never alike)

    @property
    def most(self) -> int:
        return max(self.as_rows, self.as_columns)


ALONE = Grouping(1)


@dataclass(frozen=True, slots=True)
class Batched:
    rows: int  # decode rows one matmul may hold (1: each row alone)
    lengths: tuple[int, ...] | None = None  # decode: keys of each row after this step
    # A speculative verify (engine/decode/verify.py): each row's L positions computed as
    # L consecutive decode steps of that row alone.
    verify: bool = False
    # A verify's positions of each row (`lengths`' order); past them padding, not computed
    # (verify_positions.py). None: every row's L.
    widths: tuple[int, ...] | None = None
    # False: a default-mode verify, which only skips the padding: its real positions
    # projected in one call, each row's attention one call over its own positions.
    exact: bool = True


_mode = threading.local()


def _current() -> Batched | None:
    return getattr(_mode, "batched", None)


@contextmanager
def batched(
    rows: int = 1,
    lengths: Sequence[int] | None = None,
    verify: bool = False,
    widths: Sequence[int] | None = None,
    exact: bool = True,
) -> Iterator[None]:
    """Batch-invariant forwards built in this thread inside the block: stacked prefill
    chunks (no `lengths`), a decode step (`lengths`: each row's keys after it), or with
    `verify` the positions of each row [B, L] computed like L decode steps of that row
    (`lengths`: each row's keys after its last; `widths`: its own positions, the rest
    padding that is not computed). `exact=False` (a verify by default, not
    --deterministic): the model's own numbers, only the padding skipped."""
    before = _current()
    _mode.batched = Batched(
        rows,
        tuple(lengths) if lengths is not None else None,
        verify,
        tuple(widths) if widths is not None else None,
        exact,
    )
    try:
        yield
    finally:
        _mode.batched = before


def _split(base, x: mx.array, layer: nn.Module) -> mx.array:
    """`base(x)`, with decode rows (a decode step's, a verify's) in groups that compute
    each row like `base` of that row alone: at most the step's `rows` and the layer's
    own measured group (`Grouping`); a stacked prefill sequence's rows stay together."""
    mode = _current()
    if mode is not None and not mode.exact:  # a default-mode verify: the padding skipped
        return positions.packed(base, x, mode.widths) if mode.verify and x.ndim == 3 else base(x)
    if mode is not None and mode.lengths is not None and x.ndim == 2 and x.shape[0] > 1:
        # A decode step's rows as [B, D] (Mamba-1's scan projects a position so):
        # decode rows, each computed like alone.
        return _split(base, x[:, None], layer)[:, 0]
    grouping = _grouping(layer)

    def project(group: mx.array) -> mx.array:
        if group.shape[0] <= grouping.as_rows or group.shape[1] != 1:
            return base(group)
        return _as_columns(layer, group)

    if mode is not None and mode.verify and x.ndim == 3 and x.shape[1] > 1:
        # [B, L, D] -> each row's own positions as decode rows [n, 1, D], in groups that
        # compute like one row each; the padding after a shorter row is not computed.
        batch, length, _ = x.shape
        rows = positions.real_positions(x, mode.widths)
        per = min(mode.rows, grouping.most)
        out = mx.concatenate([project(rows[i : i + per]) for i in range(0, len(rows), per)])
        return positions.padded(out, mode.widths, batch, length)
    if mode is None or x.ndim < 3 or x.shape[0] == 1:
        return base(x)
    per = _even(x.shape[0], min(mode.rows, grouping.most)) if x.shape[1] == 1 else 1
    if per >= x.shape[0]:
        return project(x)
    return mx.concatenate([project(x[i : i + per]) for i in range(0, x.shape[0], per)])


def _as_columns(layer: nn.Module, x: mx.array) -> mx.array:
    """A float linear layer (or an embedding's output head) on decode rows [n, 1, D]
    computed as W @ X^T: the rows are the matmul's columns, which the BLAS keeps apart
    for more of them than it does a matmul's rows (`measure_rows`)."""
    n, _, dims = x.shape
    y = (layer.weight @ x.reshape(n, dims).T).T  # [n, out]
    if "bias" in layer:
        y = y + layer.bias
    return y[:, None, :]


def _even(n: int, most: int) -> int:
    """Rows per group when n rows split into as few groups of at most `most` as they can,
    as even as they can be (16 in groups of 12: 8 and 8, not 12 and 4): any group of up
    to `most` rows computes each like alone."""
    groups = -(-n // most)
    return -(-n // groups)


def _grouping(layer: nn.Module) -> Grouping:
    # Set by `assign_rows`; a layer it has not measured computes each row alone.
    return getattr(layer, "_grouping", ALONE)


def _split_call(base_call):
    def __call__(self, x: mx.array) -> mx.array:
        return _split(lambda v: base_call(self, v), x, self)

    return __call__


def _split_as_linear(base_as_linear):
    def as_linear(self, x: mx.array) -> mx.array:
        return _split(lambda v: base_as_linear(self, v), x, self)

    return as_linear


def _per_row_sdpa(base):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        mode = _current()
        if mode is not None and mode.verify and mode.lengths is not None:
            args = (queries, keys, values, cache, scale, mask, sinks)
            return positions.verify_attention(base, mode.lengths, mode.widths, mode.exact, *args)
        if mode is None or mode.lengths is None or queries.shape[2] != 1:
            return base(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        # A decode step over left-padded batch caches: each row's valid keys are its last
        # `lengths[i]` (capped by what the cache holds, e.g. a sliding window).
        held = keys.shape[2]
        outs = []
        for i, length in enumerate(mode.lengths):
            start = held - min(length, held)
            row_mask = mask[i : i + 1, ..., start:] if isinstance(mask, mx.array) else mask
            outs.append(
                base(
                    queries[i : i + 1],
                    keys[i : i + 1, :, start:],
                    values[i : i + 1, :, start:],
                    cache=cache,
                    scale=scale,
                    mask=row_mask,
                    sinks=sinks,
                )
            )
        return mx.concatenate(outs)

    scaled_dot_product_attention._batch_invariant = True  # type: ignore[attr-defined]
    return scaled_dot_product_attention


_subclasses: dict[type, type] = {}
# Projections called on their input. The sharded ones (a model split by mlx-lm's
# `shard`) sum over the ranks inside: split, each row group is summed on its own, the
# same number of times on every rank.
_SHARDED = (
    AllToShardedLinear,
    ShardedToAllLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
)
_CALLED = (nn.Linear, nn.QuantizedLinear, *_SHARDED)


def _rowwise_class(cls: type[Any]) -> type:
    if cls not in _subclasses:
        namespace: dict = {}
        if issubclass(cls, _CALLED):
            namespace["__call__"] = _split_call(cls.__call__)
        else:
            namespace["as_linear"] = _split_as_linear(cls.as_linear)
        _subclasses[cls] = type(f"BatchInvariant{cls.__name__}", (cls,), namespace)
    return _subclasses[cls]


_TARGETS = (*_CALLED, nn.Embedding, nn.QuantizedEmbedding)
# Layers whose row groups `measure_rows` measures (quantized sharded ones are
# left to the startup probe).
_MEASURED = (nn.Linear, nn.QuantizedLinear, AllToShardedLinear, ShardedToAllLinear)


def install(model: nn.Module) -> None:
    """Give the model's linear and embedding layers, and the attention function of every
    mlx-lm module its layers come from, their batch-invariant behaviour (idempotent)."""
    for _, module in model.named_modules():
        cls = type(module)
        if cls in _TARGETS:
            module.__class__ = _rowwise_class(cls)
        source: Any = sys.modules.get(cls.__module__)  # an mlx-lm model module
        sdpa = getattr(source, "scaled_dot_product_attention", None)
        if sdpa is not None and not getattr(sdpa, "_batch_invariant", False):
            source.scaled_dot_product_attention = _per_row_sdpa(sdpa)
    stepwise.install(model, _in_verify)  # recurrent scans: position by position


def _in_verify() -> bool:
    mode = _current()
    return mode is not None and mode.verify


MOST_ROWS = 32  # the largest decode row group measured


def measure_rows(model: nn.Module, most: int = MOST_ROWS) -> list[Grouping]:
    """For each linear layer shape in the model (in `layer_shapes` order), how many rows
    (up to `most`) one call may hold such that each row equals the layer called on that
    row alone (random data: the BLAS picks its kernels by shape, not by values), as the
    matmul's rows and, for a float layer, as its columns."""
    key = mx.random.key(0)
    found = []
    for layer in layer_shapes(model).values():
        x = mx.random.normal((most, 1, input_width(layer)), key=key)
        as_rows = own_projection(layer)
        alone = [as_rows(x[i : i + 1]) for i in range(most)]
        grouping = Grouping(max(1, _alike_rows(as_rows, x, alone)))  # 1: alone as ever
        if _shape_key(layer)[0] in (nn.Linear, nn.Embedding):  # float, not sharded
            columns = _alike_rows(lambda v, layer=layer: _as_columns(layer, v), x, alone)
            grouping = grouping._replace(as_columns=columns)
        found.append(grouping)
    return found


def input_width(layer: nn.Module) -> int:
    """The width of the rows a linear layer (or an embedding's output head) projects."""
    return layer.weight.shape[1] * (32 // layer.bits if hasattr(layer, "bits") else 1)


def own_projection(layer: nn.Module):
    """The layer's own projection of rows (this rank's part alone, for a sharded one:
    no sum over the ranks)."""
    if isinstance(layer, _SHARDED):
        return lambda v, w=layer.weight: v @ w.T
    if isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
        return layer
    return layer.as_linear


def _alike_rows(project, x: mx.array, alone: list[mx.array]) -> int:
    """The largest m such that `project` of up to m of x's rows gives each its `alone`
    result (0 if not even one)."""
    for m in range(1, len(x) + 1):
        rows = project(x[:m])
        mx.eval(rows, alone[:m])
        if not all(mx.array_equal(rows[i : i + 1], alone[i]).item() for i in range(m)):
            return m - 1
    return len(x)


def layer_shapes(model: nn.Module) -> dict[tuple, nn.Module]:
    """One layer per measured (kind, weight shape), in the model's module order (the
    same on every rank of a sharded model)."""
    shapes: dict[tuple, nn.Module] = {}
    for _, module in model.named_modules():
        if isinstance(module, (*_MEASURED, nn.Embedding, nn.QuantizedEmbedding)):
            shapes.setdefault(_shape_key(module), module)
    return shapes


def _shape_key(module: nn.Module) -> tuple:
    cls = type(module)
    plain = cls.__mro__[1] if cls in _subclasses.values() else cls
    return (plain, tuple(module.weight.shape))


def assign_rows(model: nn.Module, found: list[Grouping]) -> int:
    """Give each batch-invariant layer the grouping measured for its shape (`found`,
    from `measure_rows`); kinds not measured get the smallest row group measured.
    Returns the largest group: the most rows a decode step may then hold."""
    by_shape = dict(zip(layer_shapes(model), found, strict=True))
    fallback = Grouping(max(1, min((g.as_rows for g in found), default=1)))
    for _, module in model.named_modules():
        if type(module) in _subclasses.values():
            module._grouping = by_shape.get(_shape_key(module), fallback)
    return max(1, max((g.most for g in found), default=1))


def consistent_rows(model: nn.Module, most: int = MOST_ROWS) -> int:
    """Measure and assign each layer's decode row group (`install` first); returns the
    most rows a decode step's matmul may hold. The tests' shorthand: the engine's
    calibration (engine/calibration.py) lets a sharded model's ranks agree in between."""
    return assign_rows(model, measure_rows(model, most))
