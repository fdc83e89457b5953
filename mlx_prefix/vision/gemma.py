"""Gemma 3's vision: a SigLIP tower, a pooling projector, bidirectional image attention.

Wired differently from Qwen3.5:
- Template: each image renders `<start_of_image>` alone; Gemma's processor turns it into
  "\\n\\n" + `<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
  `<end_of_image>` + "\\n\\n" (here at the token level: the boi id becomes
  [\\n\\n, boi, soft x N, eoi, \\n\\n]).
- Preprocessing: every image resized to image_size x image_size (bilinear), rescaled and
  normalized (SigLIP's, mean = std = 0.5): one fixed grid, N tokens whatever the size.
- Features: the tower's last hidden state, average-pooled to N tokens, RMS-normed and
  projected (mlx-vlm's Gemma3MultiModalProjector); divided by the text model's embedding
  scale, which mlx-lm's gemma3_text multiplies every input embedding by.
- Positions: one-axis RoPE at the token's index (no M-RoPE).
- Attention: causal, except that an image's tokens see each other both ways (as
  transformers' Gemma 3 masks them). The grid keeps an image in one chunk, so the
  chunk's mask holds the whole block; vision/rope.py's context carries the blocks and
  `_image_mask` adds them to mlx-lm's mask for that forward only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_prefix.vision.family import (
    ChunkInputs,
    PreparedImage,
    VisionFamily,
    build_tower,
    model_config,
    vision_weights,
)
from mlx_prefix.vision.key import ImageSpan, image_key
from mlx_prefix.vision.positions import PositionTable, plain_table

# (start, end) of each image inside the chunk being computed, relative to its start.
_BLOCKS: ContextVar[tuple[tuple[int, int], ...] | None] = ContextVar(
    "mlx_prefix_image_blocks", default=None
)


@contextmanager
def image_blocks(blocks: Sequence[tuple[int, int]] | None) -> Iterator[None]:
    token = _BLOCKS.set(tuple(blocks) if blocks else None)
    try:
        yield
    finally:
        _BLOCKS.reset(token)


def _install_mask() -> None:
    """Wrap gemma3_text's create_attention_mask once: with image blocks set, the mask is
    mlx-lm's own (causal, windowed where the layer slides) with each block opened both
    ways among the chunk's new keys (the last L columns); without, mlx-lm's as is."""
    from mlx_lm.models import gemma3_text

    original = gemma3_text.create_attention_mask
    if getattr(original, "_mlx_prefix", False):
        return

    def create_attention_mask(h, cache=None, window_size=None, return_array=False):
        blocks = _BLOCKS.get()
        if not blocks:
            return original(h, cache, window_size=window_size, return_array=return_array)
        n = h.shape[1]
        mask = original(h, cache, window_size=window_size, return_array=True)  # [n, K]
        if not isinstance(mask, mx.array):
            mask = mx.tril(mx.ones((n, n), dtype=mx.bool_))
        keys = mask.shape[-1]
        rows = mx.arange(n)[:, None]
        cols = mx.arange(keys)[None, :] - (keys - n)  # a new key's index in the chunk
        both = mx.zeros((n, keys), dtype=mx.bool_)
        for s, e in blocks:
            both = both | ((rows >= s) & (rows < e) & (cols >= s) & (cols < e))
        return mask | both

    create_attention_mask._mlx_prefix = True  # type: ignore[attr-defined]
    gemma3_text.create_attention_mask = create_attention_mask


class GemmaVision(VisionFamily):
    name = "gemma3"

    def __init__(
        self,
        tower: nn.Module,
        config: dict[str, Any],
        processing: dict[str, Any],
        *,
        newlines: Sequence[int],
    ):
        text = config["text_config"]
        super().__init__(
            tower,
            config,
            json.dumps(processing, sort_keys=True),
            placeholder=int(config.get("image_token_index", 262144)),
            opener=int(config.get("boi_token_index", 255999)),
        )
        self.closer = int(config.get("eoi_token_index", 256000))
        self.newlines = list(newlines)  # "\n\n" around an image, as Gemma's processor writes
        self.tokens = int(text.get("mm_tokens_per_image", 256))  # every image's
        self.size = int(processing["size"])  # pixels a side, after resizing
        self.mean = np.array(processing["image_mean"], dtype=np.float32)[:, None, None]
        self.std = np.array(processing["image_std"], dtype=np.float32)[:, None, None]
        # The text model scales its input embeddings by this; an image's rows undo it.
        self.scale = mx.array(text["hidden_size"] ** 0.5, mx.bfloat16)

    @classmethod
    def load(
        cls, folder: Path, config: dict[str, Any], dtype: mx.Dtype, tokenizer: Any
    ) -> GemmaVision:
        from mlx_vlm.models import gemma3
        from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
        from mlx_vlm.models.gemma3.vision import VisionModel

        built = model_config(gemma3, config)
        raw = vision_weights(folder, ("vision_tower.", "multi_modal_projector."))
        parts = _Tower(VisionModel(built.vision_config), Gemma3MultiModalProjector(built))
        weights = parts.tower.sanitize(raw)
        tower = build_tower(parts, weights, dtype, config.get("quantization"))
        processing = _processing(folder, built.vision_config.image_size)
        newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        return cls(tower, config, processing, newlines=newlines)

    def _prepare(self, pixels: Any, digest: str, processing: str) -> PreparedImage:
        from PIL import Image

        resized = pixels.resize((self.size, self.size), Image.Resampling.BILINEAR)
        arr = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        pixels = ((arr - self.mean) / self.std)[None]  # [1, 3, S, S]
        grid = (self.size, self.size)
        return PreparedImage(
            key=image_key(digest, f"{self.name};{processing}", grid),
            grid=grid,
            tokens=self.tokens,
            pixel_values=pixels,
        )

    def features(self, image: PreparedImage) -> mx.array:
        return self.tower(mx.array(image.pixel_values))[0]  # [tokens, hidden]

    def expand(
        self, ids: Sequence[int], images: Sequence[PreparedImage], param: str = "messages"
    ) -> tuple[list[int], list[ImageSpan]]:
        """Each `<start_of_image>` the template wrote becomes Gemma's full image sequence;
        then the placeholders (one per image) are the spans (VisionFamily.expand)."""
        out: list[int] = []
        for t in ids:
            if t == self.opener:
                out += [*self.newlines, self.opener, self.placeholder, self.closer, *self.newlines]
            else:
                out.append(t)
        return super().expand(out, images, param)

    def table(self, n: int, spans: Sequence[ImageSpan]) -> PositionTable:
        return plain_table(n, spans)

    def install(self, text_model: nn.Module) -> None:
        _install_mask()

    def context(self, inputs: ChunkInputs):
        return image_blocks(inputs.blocks)

    def embed_tokens(self, text_model: nn.Module) -> nn.Module:
        return text_model.language_model.model.embed_tokens

    def rows(self, features: mx.array) -> mx.array:
        return features / self.scale.astype(features.dtype)


class _Tower(nn.Module):
    """The SigLIP tower and the projector as one module (the checkpoint's key names)."""

    def __init__(self, tower: nn.Module, projector: nn.Module):
        super().__init__()
        self.vision_tower = tower
        self.multi_modal_projector = projector

    @property
    def tower(self) -> nn.Module:
        return self.vision_tower

    def __call__(self, pixels: mx.array) -> mx.array:
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        hidden, _, _ = self.vision_tower(
            pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
        )
        return self.multi_modal_projector(hidden)  # [1, tokens, text hidden]


def _processing(folder: Path, image_size: int) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    path = folder / "preprocessor_config.json"
    if path.is_file():
        raw = json.loads(path.read_text())
    size = raw.get("size") or {}
    return {
        "size": int(size.get("height", image_size)),
        "image_mean": list(raw.get("image_mean", [0.5, 0.5, 0.5])),
        "image_std": list(raw.get("image_std", [0.5, 0.5, 0.5])),
        "resample": "bilinear",
    }
