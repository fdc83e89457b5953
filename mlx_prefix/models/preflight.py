"""Checks on a model folder before it is loaded, read cheaply from its files: whether it
looks loadable (so that a server does not unload a model for one that fails) and how
much memory its weights will take (server/served/pool.py and the CLI decide with these).
Which folder a name means is models/resolve.py's business. No MLX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_prefix.errors import ModelNotFound

_HALF = ("float16", "bfloat16")
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def check_loadable(folder: Path, adapter: Path | None = None) -> None:
    """ModelNotFound unless `folder` (and `adapter`) look loadable, read cheaply before a
    server unloads a model to make room for this one: config.json an object naming its
    model_type, a tokenizer file, and weight files whose headers parse and whose tensor
    data fits in the file (a truncated download fails here, not after the unload)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"config.json unreadable ({type(e).__name__})", param="model") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelNotFound("config.json names no model_type", param="model")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelNotFound("no tokenizer file", param="model")
    weights = sorted(folder.glob("model*.safetensors"))
    if not weights:
        raise ModelNotFound("no model*.safetensors weights", param="model")
    if adapter is not None:
        weights += sorted(adapter.glob("*.safetensors"))
    for path in weights:
        _check_safetensors(path)


def _check_safetensors(path: Path) -> None:
    """The file's header parses and every tensor's bytes lie inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:
                raise ValueError("header length out of range")
            header = json.loads(f.read(n))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelNotFound(f"{path.name} is damaged ({e})", param="model") from None
    if 8 + n + max(ends, default=0) > size:
        raise ModelNotFound(f"{path.name} is truncated", param="model")


def load_estimate(folder: Path, adapter: Path | None, cpu: bool) -> int:
    """Bytes the model's weights take once loaded: the weight files' sizes, doubled for
    a half-precision checkpoint that is upcast to float32 on CPU (models/load.py's
    `choose_dtype`; quantized weights stay packed)."""
    files = list(folder.glob("model*.safetensors"))
    if adapter is not None:
        files += list(adapter.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    if cpu and _upcast_on_cpu(folder):
        size *= 2
    return size


def _upcast_on_cpu(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if config.get("quantization") or config.get("quantization_config"):
        return False
    return (config.get("torch_dtype") or config.get("dtype")) in _HALF


def context_length(config: dict[str, Any]) -> int | None:
    """The context length a model's config.json states (its text model's for a
    vision-language config); None if it states none."""
    for cfg in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(value := cfg.get(key), int) and value > 0:
                return value
    return None
