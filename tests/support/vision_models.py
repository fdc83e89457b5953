"""Tiny random-weight vision models (mlx_prefix/vision/testing.py) with the vendored
Qwen3 tokenizer and Qwen3.5's chat template, built once per test process, and images
drawn from a seed. Nothing here touches the network."""

from __future__ import annotations

import atexit
import base64
import io
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.vision.testing import make_vision_test_model
from support.models import TEST_CACHE
from support.paths import DATA

QWEN3_TOKENIZER = DATA / "tokenizers" / "qwen3"
QWEN35_TEMPLATE = DATA / "templates" / "Qwen3.5-4B.jinja"

_root: Path | None = None
# Qwen3.5's template refuses a system message anywhere but first; Claude Code 2.1.328
# sends its environment block as one after the user's message. This variant renders it
# where it stands, as Qwen3's template does.
_SYSTEM_FIRST = "{{- raise_exception('System message must be at the beginning.') }}"
_SYSTEM_HERE = "{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}"

_folders: dict[tuple[str, int, bool], Path] = {}


def vision_model_folder(
    kind: str = "qwen3_5", context: int = 8192, system_anywhere: bool = False
) -> Path:
    """The tiny vision model of `kind` with a `context`-token context (an agent's prompt
    needs 32K), the same weights whatever the context; `system_anywhere`: its template
    renders a system message wherever it stands."""
    global _root
    key = (kind, context, system_anywhere)
    if key not in _folders:
        if _root is None:
            _root = Path(tempfile.mkdtemp(prefix="mlx-prefix-vision-models-"))
            atexit.register(shutil.rmtree, _root, ignore_errors=True)
        template = QWEN35_TEMPLATE.read_text()
        if system_anywhere:
            assert _SYSTEM_FIRST in template
            template = template.replace(_SYSTEM_FIRST, _SYSTEM_HERE)
        _folders[key] = make_vision_test_model(
            kind,
            _root / f"tiny-vl-{kind}-{context}{'-system' if system_anywhere else ''}",
            tokenizer=QWEN3_TOKENIZER,
            chat_template=template,
            context=context,
        )
    return _folders[key]


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kwargs)
    return out.getvalue()


# A vision model per kind, loaded once for the tests that share it.
_loaded: dict = {}


def loaded(kind):
    if kind not in _loaded:
        _loaded[kind] = load_model(str(vision_model_folder(kind)))
    return _loaded[kind]


def vision_engine(kind: str = "qwen3_5", **engine: Any) -> Engine:
    """An engine on the shared vision model of `kind`, not prefetching a reply's next turn
    (a test's requests are what it computes); `engine`: EngineConfig's fields, or the
    engine's `disk_config`."""
    disk = engine.pop("disk_config", None)
    config = EngineConfig(prefetch_next_turn=False, **engine)
    return Engine(loaded(kind), TEST_CACHE, config, disk_config=disk)


def image(seed, size=(96, 64)):
    url = "data:image/png;base64," + base64.b64encode(encoded(picture(*size, seed=seed))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


SYSTEM = {"role": "system", "content": "You read screenshots for a developer. " * 4}


def prompt(*messages) -> PromptInput:
    return PromptInput(messages=conversation_from_dicts(list(messages)))


def user(*parts):
    return {
        "role": "user",
        "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts],
    }
