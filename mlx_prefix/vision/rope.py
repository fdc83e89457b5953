"""Multimodal RoPE (Qwen's M-RoPE) on mlx-lm's text models: positions given per forward.

mlx-lm's qwen3_5 text model rotates queries and keys with one-axis RoPE at the cache
offset. Qwen3.5's vision checkpoints were trained with M-RoPE: an image's tokens take
(t, h, w) positions from their place in the patch grid, and text after an image resumes
at the image's largest position + 1, not at its index (a 6-token image shifts what
follows by -3). Text-only tokens have t = h = w, where M-RoPE is one-axis RoPE.

`install` swaps each attention layer's `rope` for `PositionedRoPE`, which reads the
positions of the forward being built from `positions(...)` (a context the caller sets
around one model call, on the engine thread):
- none set: the layer's own RoPE at the cache offset, unchanged (a text-only prompt
  computes exactly what it computed before);
- a shift (an int, or one per batch row [B]): the own RoPE at offset + shift, for text
  after images (prefill chunks, decode rows);
- explicit positions [3, B, L]: M-RoPE from cos/sin, for a chunk holding image tokens.
The frequency layout (which axis each frequency follows) is mlx-vlm's for the model.
Positions are computed for the whole prompt on every request (vision/positions.py);
nothing of them is cached, and the module keeps no state between calls (mlx-vlm's own
language model keeps `_position_ids` / `_rope_deltas` between calls: not used here).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True, slots=True)
class RopePositions:
    """The positions of one forward: exactly one of the two is set."""

    shift: int | mx.array | None = None  # added to the cache offset ([B] for a batch)
    explicit: mx.array | None = None  # [3, B, L] per-axis positions of the chunk


_CURRENT: ContextVar[RopePositions | None] = ContextVar("mlx_prefix_rope", default=None)


@contextmanager
def positions(value: RopePositions | None) -> Iterator[None]:
    """Set the positions of the model calls made inside (None: plain offsets)."""
    token = _CURRENT.set(value)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class PositionedRoPE(nn.Module):
    """A layer's RoPE that honours the forward's positions (module docstring)."""

    def __init__(self, rope: nn.Module, dims: int, base: float, selector: Sequence[int]):
        super().__init__()
        self.rope = rope
        self.dims = dims
        self._inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2).astype(mx.float32) / dims))
        self._selector = mx.array(list(selector), dtype=mx.int32)  # axis of each frequency
        # Evaluated now: a lazy array belongs to the stream of the thread that made it
        # (a loader's), and the engine thread computes with it.
        mx.eval(self._inv_freq, self._selector)
        self.freeze()

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        given = _CURRENT.get()
        if given is None:
            return self.rope(x, offset=offset)
        if given.explicit is None:
            assert given.shift is not None  # exactly one of the two is set
            return self.rope(x, offset=offset + given.shift)
        return self._explicit(x, given.explicit)

    def _explicit(self, x: mx.array, pos: mx.array) -> mx.array:
        # x: [B, H, L, D]; pos: [3, B, L]
        axes = mx.take(pos, self._selector, axis=0)  # [F, B, L]: each frequency's axis
        freqs = axes.transpose(1, 2, 0).astype(mx.float32) * self._inv_freq  # [B, L, F]
        emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]  # [B, 1, L, dims]
        cos, sin = mx.cos(emb).astype(x.dtype), mx.sin(emb).astype(x.dtype)
        rot, rest = x[..., : self.dims], x[..., self.dims :]
        half = self.dims // 2
        turned = mx.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        out = rot * cos + turned * sin
        return mx.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def interleaved_selector(section: Sequence[int], freq_dim: int) -> list[int]:
    """Qwen3-VL / Qwen3.5's interleaved layout: frequency i follows axis 1 (h) when
    i % 3 == 1 and i < 3 * section[1], axis 2 (w) when i % 3 == 2 and i < 3 * section[2],
    else axis 0 (t) (mlx-vlm's `_interleaved_position_selector`)."""
    out = [0] * freq_dim
    for axis in (1, 2):
        for i in range(axis, min(section[axis] * 3, freq_dim), 3):
            out[i] = axis
    return out


def install(attention_layers: Sequence[nn.Module], dims: int, base: float, section: Sequence[int]):
    """Swap every layer's `rope` for a PositionedRoPE (idempotent)."""
    selector = interleaved_selector(section, dims // 2)
    for layer in attention_layers:
        if not isinstance(layer.rope, PositionedRoPE):
            layer.rope = PositionedRoPE(layer.rope, dims, base, selector)
