"""An image's place in the cache key: its placeholder span salted with its content hash.

A prompt's image is a run of placeholder tokens (`<|image_pad|>` x N for Qwen3.5), the
same ids for every image of the same size: a cache keyed on token ids alone lets a
second screenshot reuse the first one's state (vllm-mlx's issue #718). Here the trie
key replaces each placeholder of the run with a negative int64 derived from the image's
key (below -2**32: never a token id), so
- the same image at the same place gives the same key: a hit;
- another image, the same size or not, another order or a transposed image gives
  another key from the span's first token on: nothing past the image's start is shared,
  while everything before it still is (text before the first image shares with
  text-only prompts);
- the key alone tells where a span ends (the lowest bit of its last value is set), so
  the chunk grid (prompt/request/grid.py) keeps every point out of a span as a pure function of
  the key's prefix.

`image_key` binds the picture's pixel digest (vision/intake.py) to how it was processed
(the processor's parameters, the tower's signature) and to its grid: the same pixels
processed another way are another image for the cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A span's values: -(_FLOOR + 2 * ((h + j) % _MOD) + last): all below -2**32, where no
# token id (or a test's negative stand-in id) ever is, and above -2**63 (int64).
_MOD = 1 << 60
_FLOOR = 1 << 32


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image in a prompt: tokens[start:end] are its placeholders."""

    start: int
    end: int
    key: str  # image_key(...), hex
    grid: tuple[int, ...]  # the tower's grid of it (Qwen: t, h, w in patches)

    @property
    def tokens(self) -> int:
        return self.end - self.start


def image_key(pixel_digest: str, processing: str, grid: Sequence[int]) -> str:
    """The cache identity of an image as a model sees it (hex sha256)."""
    grid_text = "x".join(str(int(g)) for g in grid)
    return hashlib.sha256(f"{pixel_digest};{processing};grid={grid_text}".encode()).hexdigest()


def span_values(key: str, n: int) -> list[int]:
    """The n key values of an image's placeholder span (module docstring)."""
    h = int(key[:16], 16) % _MOD
    out = [-(_FLOOR + 2 * ((h + j) % _MOD)) for j in range(n)]
    out[-1] -= 1  # the last value's lowest bit: the span ends here
    return out


def is_image_value(value: int) -> bool:
    return value <= -_FLOOR


def ends_span(value: int) -> bool:
    """Whether `value` is the last of an image span's values."""
    return value <= -_FLOOR and (-value - _FLOOR) & 1 == 1


def inside_span(key: Sequence[int], b: int) -> bool:
    """Whether a cut after key[:b] falls inside an image span (0 < b <= len(key))."""
    return b > 0 and is_image_value(key[b - 1]) and not ends_span(key[b - 1])


def salt(ids: Sequence[int], spans: Sequence[ImageSpan]) -> list[int]:
    """The trie key of a prompt: its ids with every span's placeholders salted."""
    out = list(ids)
    for span in spans:
        out[span.start : span.end] = span_values(span.key, span.tokens)
    return out


def unsalt(key: Sequence[int], placeholder: int) -> list[int]:
    """The model's ids of a key: every image value back to the placeholder token."""
    return [placeholder if v <= -_FLOOR else v for v in key]


def readable(tokens: Sequence[int], decode: Callable[[list[int]], str]) -> str:
    """The text of a key's tokens for people (the dashboard, the request explainer): the
    text between images through `decode`, each image span written `[image]` (its values
    are keys, not token ids; a span the slice starts inside counts too)."""
    parts: list[str] = []
    text: list[int] = []
    for i, t in enumerate(tokens):
        if not is_image_value(t):
            text.append(t)
        elif i == 0 or not is_image_value(tokens[i - 1]) or ends_span(tokens[i - 1]):
            parts += [decode(text) if text else "", "[image]"]
            text = []
    parts.append(decode(text) if text else "")
    return "".join(parts)
