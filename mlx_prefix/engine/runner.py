"""MLX work for one sequence's prefill: grid-chunked, with a callback at each boundary.

Runs only on the engine thread (MLX streams are thread-local).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache

from mlx_prefix.prompt.grid import ChunkGrid

# Layers whose state can always be trimmed back to any earlier position.
_ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)


def always_trimmable(cache: list) -> bool:
    """True when no layer can ever lose trimmability (no recurrent or rotating state):
    then one snapshot at the end of the prompt serves every shorter prefix."""
    return all(type(c) in _ALWAYS_TRIMMABLE for c in cache)


def prefill_steps(
    model: nn.Module,
    cache: list,
    tokens: Sequence[int],
    start: int,
    grid: ChunkGrid,
    on_boundary: Callable[[int], None],
) -> Generator[int, None, mx.array]:
    """Compute tokens[start:] into `cache` one grid chunk per step; yields each chunk's
    end position and returns the last position's logits [1, V].

    Calls on_boundary(p) after each chunk ending at p (the cache then holds exactly
    tokens[:p]). Intermediate chunks never evaluate the LM head: only the cache states
    are evaluated, and MLX computes nothing else.
    """
    position = start
    logits = None
    for end in grid.chunk_ends(tokens, start):
        inputs = mx.array(tokens[position:end])[None]  # [1, L]
        out = model(inputs, cache=cache)  # [1, L, V] (lazy)
        if end == len(tokens):
            logits = out[:, -1, :]
            mx.eval(logits, [c.state for c in cache])
        else:
            mx.eval([c.state for c in cache])
        position = end
        on_boundary(end)
        yield end
    assert logits is not None
    return logits


def prefill(
    model: nn.Module,
    cache: list,
    tokens: Sequence[int],
    start: int,
    grid: ChunkGrid,
    on_boundary: Callable[[int], None],
) -> mx.array:
    """All of prefill_steps at once; returns the last position's logits [1, V]."""
    steps = prefill_steps(model, cache, tokens, start, grid, on_boundary)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def greedy_continue(model: nn.Module, cache: list, logits: mx.array, n: int) -> list[int]:
    """The next `n` greedy tokens after `logits` [1, V] (extends `cache`). For checks and
    benchmarks that compare a warm continuation with a cold one."""
    out: list[int] = []
    token = mx.argmax(logits, axis=-1)  # [1]
    while True:
        out.append(int(token.item()))
        if len(out) == n:
            return out
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
