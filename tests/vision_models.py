"""Tiny random-weight vision models (mlx_prefix/vision/testing.py) with the vendored
Qwen3 tokenizer and Qwen3.5's chat template, built once per test process, and images
drawn from a seed. Nothing here touches the network."""

from __future__ import annotations

import atexit
import io
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from mlx_prefix.vision.testing import make_vision_test_model

DATA = Path(__file__).parent / "data"
QWEN3_TOKENIZER = DATA / "tokenizers" / "qwen3"
QWEN35_TEMPLATE = DATA / "templates" / "Qwen3.5-4B.jinja"

_root: Path | None = None
_folders: dict[str, Path] = {}


def vision_model_folder(kind: str = "qwen3_5") -> Path:
    global _root
    if kind not in _folders:
        if _root is None:
            _root = Path(tempfile.mkdtemp(prefix="mlx-prefix-vision-models-"))
            atexit.register(shutil.rmtree, _root, ignore_errors=True)
        _folders[kind] = make_vision_test_model(
            kind,
            _root / f"tiny-vl-{kind}",
            tokenizer=QWEN3_TOKENIZER,
            chat_template=QWEN35_TEMPLATE.read_text(),
        )
    return _folders[kind]


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kwargs)
    return out.getvalue()
