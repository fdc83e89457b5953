"""The attention KV of a prefix as a chain of pieces, each token's KV stored once (MLX).

A snapshot's append-only KV layers (cache/layers/: `chained` kinds: KVCache,
ConcatenateKVCache, QuantizedKVCache) keep their positions in pieces: piece i holds
positions [start_i, end_i) of every such layer, in buffers of its own, exactly that long.
A checkpoint's chain is its parent's chain (the request restored from it) plus one piece
for what this request computed since, so a conversation's turn N+1 holds only what it
adds to turn N, and the store, which counts each buffer once (`types.Buffer`), holds each
distinct token's KV once. Recurrent and rotating state is fixed-size and stays whole in
the snapshot.

    turn 1 entry:  [0 ......... 466)                       the system prompt's piece
    turn 2 entry:  [0 ......... 466)[466 .......... 1938)  its own piece, the first shared
    turn 3 entry:  [0 ......... 466)[466 .......... 1938)[1938 .. 1945)

Why a piece is a copy (`cut`): a view keeps its whole buffer alive, and a request's live
buffer holds the prefix it restored (copied on its first append) and step padding; a
view of it would hold the prefix a second time. The copy is of the new tokens only,
once, at the boundary; it never writes into the live buffer, which goes on being
written in place.

Why assembling costs no more than a whole snapshot's restore did: a restore
(`assemble`) hands the request one lazy concatenation of the pieces plus room for the
first chunk (`KvKind.room`), so the first append writes in place into the buffer the
concatenation makes: one copy of the prefix, the copy a whole snapshot's first append
made (mlx-lm's KVCache concatenates a full buffer when it grows). A restored layer also
remembers its parts (layers/base.py `stash`) so that a merge into a batch cache (stacked tails)
copies them straight in, never the concatenation first.

Invariant 2: pieces are never written (a restored cache's buffer is the concatenation's,
or, for a single piece and no room, a view whose first append reallocates as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_prefix.cache.layers import kind_of, layers_of
from mlx_prefix.cache.types import Buffer, new_buffer_key

Parts = tuple[mx.array, ...]  # one layer's arrays; positions on axis -2


@dataclass(frozen=True, slots=True)
class Piece:
    """Positions [start, end) of every chained layer, in buffers of their own."""

    start: int
    end: int
    parts: tuple[Parts, ...]  # per chained layer (in `layers_of` order): [..., end - start, :]
    forms: tuple[type, ...]  # per chained layer: the cache class it came from
    buffer: Buffer  # the memory it holds (every part's bytes)

    def head(self, n: int) -> Piece:
        """Its first `n` positions, as views (the same buffer: it stays alive whole),
        evaluated: a snapshot's arrays may be read on another thread (MLX streams are
        thread-local)."""
        if n == self.end - self.start:
            return self
        parts = tuple(tuple(a[..., :n, :] for a in p) for p in self.parts)
        mx.eval([a for p in parts for a in p])
        return Piece(self.start, self.start + n, parts, self.forms, self.buffer)


@dataclass(frozen=True, slots=True)
class Chain:
    """Pieces covering positions [0, end) of a cache's chained layers, in order."""

    pieces: tuple[Piece, ...] = ()

    @property
    def end(self) -> int:
        return self.pieces[-1].end if self.pieces else 0

    @property
    def forms(self) -> tuple[type, ...]:
        return self.pieces[0].forms if self.pieces else ()

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return tuple({p.buffer.key: p.buffer for p in self.pieces}.values())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def upto(self, n: int) -> Chain:
        """Its first `n` positions (the last piece kept may be a shorter view)."""
        assert 0 <= n <= self.end, f"chain of {self.end} has no position {n}"
        kept = [p for p in self.pieces if p.start < n]
        if kept and kept[-1].end > n:
            kept[-1] = kept[-1].head(n - kept[-1].start)
        return Chain(tuple(kept))

    def parts(self, slot: int) -> list[Parts]:
        """One chained layer's parts, piece by piece."""
        return [p.parts[slot] for p in self.pieces]

    def arrays(self) -> list[mx.array]:
        return [a for p in self.pieces for part in p.parts for a in part]


def chained(c: Any) -> bool:
    """Whether this live layer's KV goes into a chain (append-only, not empty)."""
    return kind_of(c).chained and c.keys is not None


def extend(chain: Chain, cache: list[Any], end: int) -> Chain:
    """`chain` (the cache's first `chain.end` positions, or fewer) continued to `end` with
    a new piece copied from `cache`'s chained layers. Does not mutate `cache`. A chain
    whose layer classes differ from the cache's (its KV was quantized since) starts over
    from position 0."""
    live = [c for c in layers_of(cache) if chained(c)]
    forms = tuple(type(c) for c in live)
    for c in live:
        if c.offset != end:
            raise ValueError(f"{type(c).__name__} offset {c.offset} != checkpoint length {end}")
    if chain.forms != forms:
        chain = Chain()
    if end <= chain.end:
        return chain.upto(end)
    if not live:
        return chain
    start = chain.end
    parts = tuple(kind_of(c).cut(c, start, end) for c in live)
    mx.eval([a for p in parts for a in p])
    nbytes = sum(a.nbytes for p in parts for a in p)
    piece = Piece(start, end, parts, forms, Buffer(new_buffer_key(), nbytes))
    return Chain((*chain.pieces, piece))


def whole(parts: Sequence[Parts]) -> Parts:
    """One layer's parts as whole arrays (lazy: a disk save evaluates them one by one)."""
    if len(parts) == 1:
        return parts[0]
    return tuple(mx.concatenate(list(xs), axis=-2) for xs in zip(*parts, strict=True))


def assemble(parts: Sequence[Parts], room: int) -> Parts:
    """One layer's arrays for a restored cache: the parts one after the other, then `room`
    zero positions (lazy: the first append evaluates it, in place). A single part and no
    room: views of it, as a whole snapshot's restore gave."""
    if len(parts) == 1 and not room:
        return tuple(a[...] for a in parts[0])
    out = []
    for xs in zip(*parts, strict=True):
        pad = [mx.zeros((*xs[0].shape[:-2], room, xs[0].shape[-1]), xs[0].dtype)] if room else []
        out.append(mx.concatenate([*xs, *pad], axis=-2))
    return tuple(out)
