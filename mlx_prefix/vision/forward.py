"""One prefill chunk of a prompt with images: embeddings and positions, then the model.

The engine computes a prompt chunk by chunk on the canonical grid (invariant 4); the
grid keeps every point out of an image span (prompt/request/grid.py, vision/key.py), so a chunk
holds each of its images whole. For a chunk this module builds
- the input ids: the key's image values back to the placeholder token (the model's
  ids; their embedding rows are replaced anyway);
- the input embeddings, only when an image is in the chunk: the text model's own
  embeddings with each image's rows replaced by its features (the tower run on that
  image alone, so a hit and a miss see the same features);
- the rotary positions from the prompt's position table (computed whole for every
  request, vision/positions.py): a shift for text after images, explicit M-RoPE
  positions for a chunk with an image, nothing for text before the first image (which
  then computes exactly what a text-only prompt computes: it shares its cache entries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_prefix.vision import rope
from mlx_prefix.vision.family import ChunkInputs, PreparedImage, VisionFamily
from mlx_prefix.vision.key import unsalt
from mlx_prefix.vision.prompt import VisionPrompt

Features = Callable[[PreparedImage], mx.array]  # [tokens, hidden], evaluated


def chunk_inputs(
    model: nn.Module,
    prompt: VisionPrompt,
    key: Sequence[int],
    start: int,
    end: int,
    features: Features,
) -> ChunkInputs:
    """What the model takes for key[start:end] (module docstring)."""
    family = prompt.family
    ids = mx.array(unsalt(key[start:end], family.placeholder))[None]  # [1, L]
    inside = prompt.spans_in(start, end)
    for s in inside:
        assert start <= s.start and s.end <= end, f"chunk [{start}, {end}) splits image {s}"
    embeddings = None
    if inside:
        text = family.embed_tokens(model)(ids)[0]  # [L, H]
        pieces, at = [], start
        for s in inside:
            pieces.append(text[at - start : s.start - start])
            rows = family.rows(features(prompt.images[s.key])).astype(text.dtype)
            pieces.append(rows)
            at = s.end
        pieces.append(text[at - start :])
        embeddings = mx.concatenate([p for p in pieces if p.shape[0]], axis=0)[None]
    where = prompt.table.chunk(start, end)
    if where.explicit is not None:
        positions = rope.RopePositions(explicit=mx.array(where.explicit)[:, None, :])
    elif where.shift:
        positions = rope.RopePositions(shift=where.shift)
    else:
        positions = None
    blocks = tuple((s.start - start, s.end - start) for s in inside)
    return ChunkInputs(ids, embeddings, positions, blocks)


def forward_chunk(
    model: nn.Module, family: VisionFamily, inputs: ChunkInputs, cache: list
) -> mx.array:
    """The model on one chunk's inputs: logits [1, L, V] (lazy)."""
    with family.context(inputs):
        if inputs.embeddings is None:
            return model(inputs.ids, cache=cache)
        return model(inputs.ids, cache=cache, input_embeddings=inputs.embeddings)


def decode_positions(deltas: Sequence[int]) -> rope.RopePositions | None:
    """The positions of a decode step whose rows have these deltas (None: all zero)."""
    if not any(deltas):
        return None
    if len(deltas) == 1:
        return rope.RopePositions(shift=int(deltas[0]))
    return rope.RopePositions(shift=mx.array(list(deltas), dtype=mx.int32))


@dataclass(frozen=True, eq=False)
class VisionChunks:
    """What the prefill runner needs to compute a prompt with images chunk by chunk."""

    prompt: VisionPrompt
    features: Features  # the engine's feature cache (vision/features.py)

    def forward(
        self, model: nn.Module, cache: list, key: Sequence[int], start: int, end: int
    ) -> mx.array:
        inputs = chunk_inputs(model, self.prompt, key, start, end, self.features)
        return forward_chunk(model, self.prompt.family, inputs, cache)  # [1, L, V]
