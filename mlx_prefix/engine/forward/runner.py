"""MLX work for prefill: grid chunks of one or several sequences, one evaluation a step.

A step computes the next grid chunk of each sequence given. Chunks that start at the
same position and have the same length are stacked into one forward [B, L] with
row-wise projections (engine/forward/rowwise.py), which reproduces each sequence's alone run bit
for bit; every other chunk runs its own forward. Either way the whole step is evaluated
at once. Runs only on the engine thread (MLX streams are thread-local).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn

from mlx_prefix.cache.layers import kind_of
from mlx_prefix.engine.forward.head import last_position_head
from mlx_prefix.engine.forward.rowwise import batched
from mlx_prefix.prompt.request.grid import ChunkGrid
from mlx_prefix.vision.forward import VisionChunks

P = ParamSpec("P")
R = TypeVar("R")


def always_trimmable(cache: list) -> bool:
    """True when no layer can ever lose trimmability (no recurrent, rotating or
    quantized state: cache/layers/): then one snapshot at the end of the prompt serves
    every shorter prefix."""
    return all(kind_of(c).always_trimmable for c in cache)


class PrefillCursor:
    """Where one sequence's prefill stands on its grid: the chunks still to compute."""

    def __init__(self, tokens: Sequence[int], start: int, grid: ChunkGrid):
        self.tokens = tokens
        self.position = start
        self._ends = grid.chunk_ends(tokens, start)
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next == len(self._ends)

    def next_chunk(self) -> tuple[int, int]:
        """(start, end) of the next chunk."""
        return self.position, self._ends[self._next]

    def advance(self) -> int:
        """Mark the next chunk computed; returns its end."""
        self.position = self._ends[self._next]
        self._next += 1
        return self.position

    def finish(self) -> int:
        """Mark every chunk left computed (a stacked rest: engine/prefill/tails.py)."""
        self.position, self._next = self._ends[-1], len(self._ends)
        return self.position


@dataclass(slots=True)
class ChunkWork:
    """One sequence's next chunk: tokens[start:end] into `cache` (a list, updated in
    place: a grouped forward swaps its layer caches for ones holding the result)."""

    cache: list
    tokens: Sequence[int]
    start: int
    end: int
    # A prompt with images: its chunks compute alone, through vision/forward.py.
    vision: VisionChunks | None = None

    @property
    def last(self) -> bool:
        return self.end == len(self.tokens)


def compute_chunks(
    model: nn.Module, works: Sequence[ChunkWork], group: bool = True
) -> list[mx.array | None]:
    """Compute every work's chunk, all evaluated together; returns the last position's
    logits [1, V] for works whose chunk ends the prompt, None for the others.

    With `group`, works with equal (start, length) share one stacked forward. Only the
    cache states (and final logits) are evaluated: intermediate chunks never compute the
    LM head, and a prompt's last chunk computes it on its last position only (head.py:
    L' is 1 where the model's head is found, else L).
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for i, w in enumerate(works):
        key = (w.start, w.end - w.start) if group and w.vision is None else (i, -1)
        groups.setdefault(key, []).append(i)
    logits: list[mx.array | None] = [None] * len(works)
    for members in groups.values():
        if len(members) == 1:
            w = works[members[0]]
            with last_position_head() if w.last else nullcontext():
                if w.vision is not None:
                    out = w.vision.forward(model, w.cache, w.tokens, w.start, w.end)
                else:
                    chunk = mx.array(tuple(w.tokens[w.start : w.end]))[None]  # [1, L']
                    out = model(chunk, cache=w.cache)  # [1, L', V]
            if w.last:
                logits[members[0]] = out[:, -1, :]  # out: [1, L', V]
            continue
        first = works[members[0]].cache
        merged = [_merge([works[i].cache[n] for i in members]) for n in range(len(first))]
        inputs = mx.array([list(works[i].tokens[works[i].start : works[i].end]) for i in members])
        ends = any(works[i].last for i in members)
        with batched(), last_position_head() if ends else nullcontext():
            out = model(inputs, cache=merged)  # [B, L', V]
        for row, i in enumerate(members):
            works[i].cache[:] = [layer.extract(row) for layer in merged]
            if works[i].last:
                logits[i] = out[row : row + 1, -1, :]
    mx.eval([x for x in logits if x is not None], [[c.state for c in w.cache] for w in works])
    return logits


def _merge(layers: list) -> Any:
    """mlx-lm's merge of one layer of several sequences; a KV layer restored from a chain
    of pieces merges from them (cache/layers/kv.py: one copy, not two)."""
    kind = kind_of(layers[0])
    return kind.merge(layers, 0) if kind.chained else type(layers[0]).merge(layers)


def compute_tails(model: nn.Module, works: Sequence[ChunkWork], padded: bool) -> list[mx.array]:
    """The rest of several prompts, tokens[start:], in one batch (engine/prefill/tails.py);
    returns each one's last logits [1, V]. Each work's `cache` then holds its own row.

    As mlx_lm's BatchGenerator prefills: every rest but its last token in one forward
    whose logits are never computed (histories of different lengths left-padded by the
    merge; with `padded`, rests of different lengths right-padded, the batch cache
    masking the padding and moving it to the left after), then the last tokens in a
    second forward of one token a row: the LM head runs on B positions, not B x L."""
    lengths = [w.end - w.start - 1 for w in works]  # before each last token
    longest = max(lengths)
    assert padded or min(lengths) == longest, "rests of one length only without padding"
    layers = zip(*(w.cache for w in works), strict=True)
    merged = [kind_of(same[0]).merge(same, 0) for same in layers]
    if longest:
        padding = [longest - n for n in lengths]
        if any(padding):
            for layer in merged:
                layer.prepare(lengths=lengths, right_padding=padding)
        rows = [
            list(w.tokens[w.start : w.end - 1]) + [0] * p
            for w, p in zip(works, padding, strict=True)
        ]
        model(mx.array(rows), cache=merged)  # only the caches are used: lazy, no LM head
        if any(padding):
            for layer in merged:
                layer.finalize()
    last = mx.array([[w.tokens[w.end - 1]] for w in works])
    out = model(last, cache=merged)[:, -1, :]  # [B, V]
    logits = [out[i : i + 1] for i in range(len(works))]
    for row, w in enumerate(works):
        w.cache[:] = [layer.extract(row) for layer in merged]
    mx.eval(logits, [[c.state for c in w.cache] for w in works])
    return logits


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
    tokens[:p]).
    """
    cursor = PrefillCursor(tokens, start, grid)
    logits = None
    while not cursor.done:
        begin, end = cursor.next_chunk()
        (logits,) = compute_chunks(model, [ChunkWork(cache, tokens, begin, end)])
        cursor.advance()
        on_boundary(end)
        yield end
    assert logits is not None
    return logits


def to_the_end(steps: Callable[P, Generator[Any, None, R]]) -> Callable[P, R]:
    """A stepping generator function run at once: same arguments, its return value."""

    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        generator = steps(*args, **kwargs)
        while True:
            try:
                next(generator)
            except StopIteration as done:
                return cast(R, done.value)

    return run


# All of prefill_steps at once; returns the last position's logits [1, V].
prefill = to_the_end(prefill_steps)


def greedy_continue(model: nn.Module, cache: list, logits: mx.array, n: int) -> list[int]:
    """The next `n` greedy tokens after `logits` [1, V] (extends `cache`). For checks and
    benchmarks that compare a warm continuation with a cold one."""
    out: list[int] = []
    token = mx.argmax(logits, axis=-1)  # [1]
    while True:
        out.append(int(cast(int, token.item())))
        if len(out) == n:
            return out
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
