"""Which model folder an operator's model name means (a --model-alias target, an
--allowed-models entry), without ever touching the network, whether it looks loadable,
and how much memory loading it would take (server/model_pool.py decides with these).
A request's own name is never looked up here: what exists on disk is not its business.

A name is a local folder (it exists), a path that does not exist (absolute, `./`, `../`
or `~`: ModelNotFound), a Hugging Face repo id already in the local hub cache, or none
of these (None: the caller decides, e.g. the default model answers).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.resolve import ResolvedModel

_PATH_PREFIXES = ("/", "./", "../", "~")
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
_HALF = ("float16", "bfloat16")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def find_local_model(name: str) -> ResolvedModel | None:
    """The folder `name` selects (see the module docstring); None if it names none.
    Raises ModelNotFound for a path that is missing or not a model folder."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith(_PATH_PREFIXES):
        if not (path / "config.json").is_file():
            why = "no config.json in that folder" if path.is_dir() else "no such folder"
            raise ModelNotFound(f"model '{name}' not found: {why}", param="model")
        resolved = path.resolve()
        return ResolvedModel(path=resolved, name=resolved.name, source=str(resolved))
    repo_id, _, revision = name.partition("@")
    if _REPO_ID.fullmatch(repo_id):
        return _cached_hub_model(repo_id, revision or None)
    return None


def _cached_hub_model(repo_id: str, revision: str | None) -> ResolvedModel | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    from mlx_prefix.models.resolve import _ALLOW_PATTERNS

    try:
        # local_files_only: the cache is consulted, the Hub never is.
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=_ALLOW_PATTERNS, local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    if not (folder / "config.json").is_file():
        return None
    return ResolvedModel(path=folder, name=repo_id, source=f"{repo_id}@{folder.name}")


def adapter_folder(adapter: str) -> Path:
    """A LoRA adapter folder (holding adapter_config.json), resolved; ModelNotFound else."""
    path = Path(adapter).expanduser()
    if not (path / "adapter_config.json").is_file():
        raise ModelNotFound(
            f"adapter '{adapter}' not found: no adapter_config.json in that folder",
            param="adapters",
        )
    return path.resolve()


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
