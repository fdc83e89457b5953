"""A prompt's rotary positions with images in it, computed whole on every request.

Qwen's M-RoPE (Qwen2-VL on; Qwen3.5 as mlx-vlm's `get_rope_index` computes it) gives
every token three positions (t, h, w). Text takes t = h = w = the next position. An
image of t x h x w merged patches takes t, h and w from its place in that grid, each
offset by the position where it starts; the text after it resumes at the largest of its
positions + 1. So a 1 x 2 x 3 image (6 tokens) starting at position 4 takes positions
4..6, and the text after it starts at 7 where its index is 10: its positions are shifted
by -3 from its index, and every later token carries that shift (the `delta` a decode step
adds to its cache offset).

The table depends on the whole prompt before a position (the images and where they
stand), never on what the cache holds: a restored request computes it again from its own
prompt, so a hit and a miss rotate every token alike (vision/rope.py applies it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlx_prefix.vision.key import ImageSpan


@dataclass(frozen=True, eq=False)
class PositionTable:
    """Per-axis positions [3, N] of a prompt's N tokens, and the shift after its end."""

    axes: np.ndarray  # [3, N] int32
    delta: int  # position - index of every token after the prompt (decode)
    spans: tuple[ImageSpan, ...]
    multi_axis: bool = True  # False: one-axis RoPE, every token at its index

    def chunk(self, start: int, end: int) -> ChunkPositions:
        """How tokens [start, end) are rotated: a shift of their index when no image
        token is among them (their three axes agree), else their explicit positions."""
        if not self.multi_axis:
            return ChunkPositions()
        if not any(s.start < end and start < s.end for s in self.spans):
            return ChunkPositions(shift=int(self.axes[0, start]) - start)
        return ChunkPositions(explicit=self.axes[:, start:end])


@dataclass(frozen=True, eq=False)
class ChunkPositions:
    shift: int = 0  # position = index + shift, on every axis
    explicit: np.ndarray | None = None  # [3, L] positions when an image is in the chunk


def mrope_table(n: int, spans: Sequence[ImageSpan], merge: int) -> PositionTable:
    """M-RoPE positions of a prompt of n tokens with `spans` (grids in patches: t, h, w;
    `merge` patches per side become one token)."""
    axes = np.empty((3, n), dtype=np.int32)
    cursor, nxt = 0, 0
    ordered = sorted(spans, key=lambda s: s.start)
    for span in ordered:
        gap = span.start - cursor
        axes[:, cursor : span.start] = nxt + np.arange(gap, dtype=np.int32)
        nxt += gap
        t, h, w = span.grid[0], span.grid[1] // merge, span.grid[2] // merge
        assert t * h * w == span.tokens, f"grid {span.grid} / {merge} != {span.tokens} tokens"
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        axes[0, span.start : span.end] = nxt + ti.reshape(-1)
        axes[1, span.start : span.end] = nxt + hi.reshape(-1)
        axes[2, span.start : span.end] = nxt + wi.reshape(-1)
        nxt = int(axes[:, span.start : span.end].max()) + 1
        cursor = span.end
    axes[:, cursor:] = nxt + np.arange(n - cursor, dtype=np.int32)
    delta = (int(axes.max()) + 1 - n) if n else 0
    return PositionTable(axes=axes, delta=delta, spans=tuple(ordered))


def plain_table(n: int, spans: Sequence[ImageSpan]) -> PositionTable:
    """One-axis positions (models without M-RoPE: Gemma 3): every token at its index."""
    axes = np.broadcast_to(np.arange(n, dtype=np.int32), (3, n))
    ordered = tuple(sorted(spans, key=lambda s: s.start))
    return PositionTable(axes=axes, delta=0, spans=ordered, multi_axis=False)
