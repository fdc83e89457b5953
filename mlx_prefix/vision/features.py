"""The vision-feature cache: an image's tower output by image key, in a byte budget.

The prefix cache restores an image's effect on the text model's state; when it no
longer covers the image (evicted, or a conversation edited before it), the prefill runs
through the image again and needs its features. Keeping them saves the tower's forward:
the same screenshot sent again in every turn of an agent's session, or a prefetch and
the turn it prepares. Features are a pure function of the image key (the tower runs
each image alone), so a cached copy is exactly what a new forward would compute.

LRU by bytes under `max_bytes` (a share of the cache's byte budget: engine/keys.py and
the budget count it); an image larger than the whole cap is computed and not kept.
Runs on the engine thread only (MLX arrays); `stats` may be read from any thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

from mlx_prefix.vision.family import PreparedImage, VisionFamily


@dataclass(frozen=True, slots=True)
class FeatureStats:
    entries: int
    nbytes: int
    max_bytes: int
    hits: int
    misses: int


class FeatureCache:
    def __init__(self, family: VisionFamily, max_bytes: int):
        self.family = family
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, mx.array] = OrderedDict()
        self._nbytes = 0
        self._hits = 0
        self._misses = 0

    def __call__(self, image: PreparedImage) -> mx.array:
        """The image's features [tokens, hidden], evaluated; computed on a miss."""
        found = self._entries.get(image.key)
        if found is not None:
            self._entries.move_to_end(image.key)
            self._hits += 1
            return found
        self._misses += 1
        features = self.family.features(image)
        mx.eval(features)
        if features.nbytes <= self.max_bytes:
            self._entries[image.key] = features
            self._nbytes += features.nbytes
            while self._nbytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._nbytes -= old.nbytes
        return features

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._nbytes = 0

    def stats(self) -> FeatureStats:
        return FeatureStats(
            len(self._entries), self._nbytes, self.max_bytes, self._hits, self._misses
        )
