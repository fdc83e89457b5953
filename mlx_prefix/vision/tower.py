"""A vision checkpoint's vision part: which family serves it, and whether it has one.

A family is chosen by the config's model_type from `FAMILIES` (its module imported only
when a model of it loads, as mlx-lm picks a model's module by type); each family module
builds on the shared types of vision/family.py, never on this one. A folder without a
`vision_config`, or whose files hold no tower (`carries_tower`), is a text-only model (None).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from safetensors import safe_open

from mlx_prefix.vision.family import VisionFamily

# model_type -> "module:class" of the family that serves it (each class has a `load`).
FAMILIES: dict[str, str] = {
    "qwen3_5": "mlx_prefix.vision.qwen:QwenVision",
    "qwen3_5_moe": "mlx_prefix.vision.qwen:QwenVision",
    "gemma3": "mlx_prefix.vision.gemma:GemmaVision",
}


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


_TOWER_PREFIX = "vision_tower."  # where mlx-vlm's layout keeps every family's tower


def is_vision_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict)


def carries_tower(folder: Path) -> bool:
    """Whether the folder's safetensors hold a vision tower. mlx-lm's convert keeps a
    vision checkpoint's `vision_config` but drops its tower (many published Qwen3.5 and
    Gemma 3 conversions): such a folder is a text model. Only the files' headers are read."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            if any(k.startswith(_TOWER_PREFIX) for k in f.keys()):  # noqa: SIM118
                return True
    return False


def load_vision(folder: Path, dtype: mx.Dtype, tokenizer: Any) -> VisionFamily | None:
    """The folder's vision part, or None for a text-only model. A vision config of a
    family not served here raises ValueError (a load error)."""
    config = read_config(folder)
    if not is_vision_config(config):
        return None
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(
            f"this model's vision tower ({kind!r}) is not supported: served families are "
            "qwen3_5, qwen3_5_moe and gemma3"
        )
    module, name = FAMILIES[kind].split(":")
    family: type[VisionFamily] = getattr(importlib.import_module(module), name)
    return family.load(Path(folder), config, dtype, tokenizer)
