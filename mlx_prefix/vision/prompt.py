"""A prompt's images as the engine computes them: built when the prompt is planned
(prompt/request/plan.py), read by every prefill chunk (vision/forward.py) and decode step.
No MLX here: the planner runs in the caller's thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_prefix.vision.key import ImageSpan
from mlx_prefix.vision.positions import PositionTable

if TYPE_CHECKING:
    from mlx_prefix.vision.family import PreparedImage, VisionFamily


@dataclass(frozen=True, eq=False)
class VisionPrompt:
    family: VisionFamily
    spans: tuple[ImageSpan, ...]  # ascending, never overlapping
    table: PositionTable  # the whole prompt's positions
    images: dict[str, PreparedImage]  # by image key

    @property
    def delta(self) -> int:
        """What a decode step adds to its cache offset for a rotary position."""
        return self.table.delta

    @property
    def image_tokens(self) -> int:
        return sum(s.tokens for s in self.spans)

    def spans_in(self, start: int, end: int) -> list[ImageSpan]:
        return [s for s in self.spans if s.start < end and start < s.end]


def describe(prompt: Any) -> str:
    """One line for logs: how many images and image tokens a planned prompt holds."""
    vision = getattr(prompt, "vision", None)
    if vision is None:
        return "no images"
    return f"{len(vision.spans)} images, {vision.image_tokens} image tokens"
