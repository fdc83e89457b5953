"""What every vision family gives the engine: images prepared, encoded and placed.

A vision checkpoint (as mlx-community publishes them: mlx-vlm's layout, `vision_tower.*`
beside `language_model.*` in the same safetensors) is served as two parts:
- the text model, loaded by mlx-lm as every other model (mlx-lm's sanitize drops the
  vision weights): its caches, batching, sharding and kernels are the engine's own;
- the family's vision part (a VisionFamily): the tower, built from mlx-vlm's classes
  and the `vision_tower.*` weights of the same files, and what the text model needs
  to take an image: where its tokens go, their rotary positions, their embeddings.
Why not mlx-vlm's whole model: its language models keep their own cache classes and
state between calls (mlx-lm's ArraysCache has no `update_window`; `_position_ids` /
`_rope_deltas` persist on the module), where the engine's snapshots, batching and
sharding are built on mlx-lm's. The towers are stateless functions of one image.

This module holds the types every family shares and the helpers that build a tower; a
family (qwen.py, gemma.py) imports them, and tower.py picks the family by model type.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_prefix.arrays import drop_parameters, load_safetensors
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.vision.intake import EncodedImage, ImageInput
from mlx_prefix.vision.key import ImageSpan
from mlx_prefix.vision.positions import PositionTable
from mlx_prefix.vision.prepared import PreparedCache
from mlx_prefix.vision.rope import RopePositions, positions

LOW_DETAIL_SIDE = 512  # detail "low": the image fits in this square first


@dataclass(frozen=True, eq=False)
class ChunkInputs:
    """What the text model takes for one prefill chunk (vision/forward.py builds it)."""

    ids: mx.array  # [1, L]
    embeddings: mx.array | None  # [1, L, H] when an image is in the chunk
    positions: RopePositions | None  # None: the cache offset as is
    blocks: tuple[tuple[int, int], ...] = ()  # each image's [start, end) in the chunk


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """An image as its tower takes it: pixel values, grid, token count and cache key."""

    key: str  # vision/key.py's image_key
    grid: tuple[int, ...]
    tokens: int  # placeholders it takes in the prompt
    pixel_values: np.ndarray = field(repr=False)


class VisionFamily:
    """One family's vision part (module docstring), built whole by its `load`."""

    name: str = ""

    def __init__(
        self,
        tower: nn.Module,
        config: dict[str, Any],
        processing: str,
        *,
        placeholder: int,
        opener: int,
    ):
        self.tower = tower
        self.config = config
        self.processing = processing  # the preprocessing parameters, as text (in the key)
        self.placeholder = placeholder  # the id each image's span is filled with
        self.opener = opener  # the special token right before every span: a grid point
        # The same image in the next turns is prepared once (vision/prepared.py: by
        # bytes; pixel values can be hundreds of MB).
        self.prepared: PreparedCache[PreparedImage] = PreparedCache(lambda p: p.pixel_values.nbytes)

    @classmethod
    def load(
        cls, folder: Path, config: dict[str, Any], dtype: mx.Dtype, tokenizer: Any
    ) -> VisionFamily:
        """The family's vision part from a checkpoint folder (its config already read)."""
        raise NotImplementedError

    def prepare_input(self, item: ImageInput) -> PreparedImage:
        """`item` as this tower takes it, kept for the next request that sends it. An
        image seen for the first time is decoded once, for its digest (the key) and,
        on a miss, its preparation."""
        image = item.image
        picture = None if image.digested else image.rgb()
        return self.prepared.get(item.identity, lambda: self.prepare(image, item.detail, picture))

    def close(self) -> None:
        """Let go of everything this family holds (its model's unload): the images it
        prepared and the tower's weights. Whatever still holds the family (a request
        finishing, a view) keeps a few Python objects, not the memory."""
        self.prepared.clear()
        drop_parameters(self.tower)

    def prepare(
        self, image: EncodedImage, detail: str = "auto", picture: Any = None
    ) -> PreparedImage:
        """The image as this tower takes it (`picture`: its RGB, already decoded; else
        decoded for this, never kept); `detail` "low" fits it in 512 x 512 first
        (OpenAI's low-resolution mode: fewer tokens), and is then part of its key."""
        low = detail == "low"
        pixels = picture if picture is not None else image.rgb()
        if low:
            pixels = low_detail(pixels)
        return self._prepare(pixels, image.digest, self.processing + (";detail=low" if low else ""))

    def _prepare(self, pixels: Any, digest: str, processing: str) -> PreparedImage:
        raise NotImplementedError

    def features(self, image: PreparedImage) -> mx.array:
        """The tower run on this image alone: [tokens, hidden], as embedding rows."""
        raise NotImplementedError

    def expand(
        self, ids: Sequence[int], images: Sequence[PreparedImage], param: str = "messages"
    ) -> tuple[list[int], list[ImageSpan]]:
        """The rendered ids (one placeholder per image, as the template writes it) with
        every image's placeholder repeated to its token count; the spans they fill."""
        at = [i for i, t in enumerate(ids) if t == self.placeholder]
        if len(at) != len(images):
            raise InvalidRequest(
                f"the prompt holds {len(at)} image placeholders for {len(images)} images "
                "(does a message's text contain the model's image token?)",
                param=param,
            )
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for pos, image in zip(at, images, strict=True):
            out += ids[prev:pos]
            spans.append(ImageSpan(len(out), len(out) + image.tokens, image.key, image.grid))
            out += [self.placeholder] * image.tokens
            prev = pos + 1
        out += ids[prev:]
        return out, spans

    def table(self, n: int, spans: Sequence[ImageSpan]) -> PositionTable:
        raise NotImplementedError

    def install(self, text_model: nn.Module) -> None:
        """Adapt the text model to take explicit positions (idempotent)."""

    def context(self, inputs: ChunkInputs) -> AbstractContextManager[None]:
        """What a forward of `inputs` runs inside (the positions it reads)."""
        return positions(inputs.positions)

    def embed_tokens(self, text_model: nn.Module) -> nn.Module:
        return text_model.model.embed_tokens

    def rows(self, features: mx.array) -> mx.array:
        """Features as the text model's input embeddings (Gemma undoes its scaling)."""
        return features


def model_config(module: Any, config: dict[str, Any]) -> Any:
    """mlx-vlm's ModelConfig of `module` from a config dict, its nested configs built too
    (some families' from_dict leaves them dicts; mlx-vlm's loader fills them in)."""
    built = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    for name, cls in (("text_config", "TextConfig"), ("vision_config", "VisionConfig")):
        if isinstance(getattr(built, name, None), dict) and hasattr(module, cls):
            setattr(built, name, getattr(module, cls).from_dict(getattr(built, name)))
    return built


def vision_weights(folder: Path, prefixes: Sequence[str]) -> dict[str, mx.array]:
    """The weights under `prefixes` from the folder's safetensors, prefix kept."""
    out: dict[str, mx.array] = {}
    for path in sorted(glob.glob(str(Path(folder) / "*.safetensors"))):
        for k, v in load_safetensors(path).items():
            if k.startswith(tuple(prefixes)):
                out[k] = v
    return out


def build_tower(
    module: nn.Module,
    weights: dict[str, mx.array],
    dtype: mx.Dtype,
    quantization: dict[str, Any] | None = None,
) -> nn.Module:
    """`module` with `weights` (its own key names), floating ones cast to `dtype`, frozen
    and evaluated: a tower is never trained here."""
    if quantization and any(k.endswith(".scales") for k in weights):
        # Quantized where the checkpoint holds scales, as mlx-lm loads quantized layers.
        nn.quantize(
            module,
            group_size=quantization.get("group_size", 64),
            bits=quantization.get("bits", 4),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    module.load_weights(list(weights.items()), strict=True)
    cast = {
        k: v.astype(dtype)
        for k, v in weights.items()
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype
    }
    if cast:
        module.load_weights(list(cast.items()), strict=False)
    module.eval()
    module.freeze()
    mx.eval(module.parameters())
    return module


def low_detail(picture: Any) -> Any:
    """A PIL picture fitted in LOW_DETAIL_SIDE x LOW_DETAIL_SIDE (aspect kept; never
    enlarged), as a copy."""
    from PIL import Image

    pixels = picture.copy()
    pixels.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE), Image.Resampling.BICUBIC)
    return pixels
