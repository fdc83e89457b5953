"""Qwen3.5's vision (qwen3_5 dense and qwen3_5_moe; the text model is the hybrid).

- Template: each image renders `<|vision_start|><|image_pad|><|vision_end|>`; the one
  `<|image_pad|>` becomes t*h*w / merge^2 of them (the tower's merged patches).
- Preprocessing: mlx-vlm's numpy port of Qwen's image processor (smart resize to a
  multiple of patch x merge between min and max pixels, normalize, patchify), with the
  parameters of the folder's preprocessor_config.json (read here: mlx-vlm's reader falls
  back to the hub).
- Tower: mlx-vlm's qwen3_5 VisionModel (deepstack off for Qwen3.5), one image a call.
- Positions: M-RoPE (vision/positions.py), applied by vision/rope.py on mlx-lm's attention.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_prefix.vision.family import PreparedImage, VisionFamily, build_tower, vision_weights
from mlx_prefix.vision.key import ImageSpan, image_key
from mlx_prefix.vision.positions import PositionTable, mrope_table
from mlx_prefix.vision.rope import install as install_rope

# preprocessor_config.json keys the processor takes, and the defaults mlx-vlm uses.
_PROCESSOR_KEYS = (
    "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
    "rescale_factor", "do_rescale", "do_normalize", "min_pixels", "max_pixels",
)  # fmt: skip


def processor_kwargs(folder: Path) -> dict[str, Any]:
    """The Qwen image processor's arguments from the folder (no hub fallback)."""
    raw: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text())
            raw.update(data.get("image_processor", data) if name.startswith("processor") else data)
    size = raw.get("size") or {}
    if size.get("shortest_edge") is not None:
        raw.setdefault("min_pixels", size["shortest_edge"])
    if size.get("longest_edge") is not None:
        raw.setdefault("max_pixels", size["longest_edge"])
    out = {"patch_size": 16}
    out.update({k: raw[k] for k in _PROCESSOR_KEYS if k in raw})
    return out


@dataclass(frozen=True)
class MRope:
    """The text model's rotary embedding, as M-RoPE needs it."""

    dims: int  # rotated dimensions of a head
    base: float
    section: tuple[int, ...]  # frequencies per axis (t, h, w)

    @classmethod
    def of(cls, config: dict[str, Any]) -> MRope:
        text = config.get("text_config", config)
        rope = text["rope_parameters"] if "rope_parameters" in text else text["rope_scaling"]
        return cls(
            dims=int(text["head_dim"] * rope.get("partial_rotary_factor", 1.0)),
            base=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            section=tuple(rope["mrope_section"]),
        )


class QwenVision(VisionFamily):
    name = "qwen3_5"

    def __init__(
        self,
        tower: nn.Module,
        config: dict[str, Any],
        processing: str,
        *,
        processor: Any,
        merge: int,
        rope: MRope,
    ):
        super().__init__(
            tower,
            config,
            processing,
            placeholder=int(config.get("image_token_id") or config["image_token_index"]),
            opener=int(config["vision_start_token_id"]),
        )
        self.processor = processor  # mlx-vlm's numpy image processor
        self.merge = merge  # patches merged per side into one token
        self.rope = rope

    @classmethod
    def load(
        cls, folder: Path, config: dict[str, Any], dtype: mx.Dtype, tokenizer: Any = None
    ) -> QwenVision:
        import importlib

        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

        module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
        vision_config = module.VisionConfig.from_dict(config["vision_config"])
        raw = vision_weights(folder, ("vision_tower.",))
        tower = module.VisionModel(vision_config)
        weights = tower.sanitize({k.removeprefix("vision_tower."): v for k, v in raw.items()})
        tower = build_tower(tower, weights, dtype, config.get("quantization"))
        kwargs = processor_kwargs(folder)
        return cls(
            tower,
            config,
            json.dumps(kwargs, sort_keys=True),
            processor=Qwen3VLImageProcessor(**kwargs),
            merge=int(vision_config.spatial_merge_size),
            rope=MRope.of(config),
        )

    def _prepare(self, pixels: Any, digest: str, processing: str) -> PreparedImage:
        out = self.processor([pixels])
        grid = tuple(int(g) for g in out["image_grid_thw"][0])
        tokens = grid[0] * grid[1] * grid[2] // self.merge**2
        return PreparedImage(
            key=image_key(digest, f"{self.name};{processing}", grid),
            grid=grid,
            tokens=tokens,
            pixel_values=out["pixel_values"],
        )

    def features(self, image: PreparedImage) -> mx.array:
        dtype = self.tower.patch_embed.proj.weight.dtype
        pixels = mx.array(image.pixel_values).astype(dtype)
        hidden, _ = self.tower(pixels, mx.array([image.grid]))
        assert hidden.shape[0] == image.tokens, (hidden.shape, image.tokens)
        return hidden  # [tokens, hidden]

    def table(self, n: int, spans: Sequence[ImageSpan]) -> PositionTable:
        return mrope_table(n, spans, self.merge)

    def install(self, text_model: nn.Module) -> None:
        layers = [layer.self_attn for layer in text_model.layers if hasattr(layer, "self_attn")]
        install_rope(layers, self.rope.dims, self.rope.base, list(self.rope.section))
