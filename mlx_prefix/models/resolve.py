"""Model naming: what folder a model name means, in one place.

A name is the bundled default (None or DEFAULT_MODEL_NAME), a local folder, a folder's
name under `$MLX_PREFIX_HOME/models`, or a Hugging Face repo id (`org/repo`, optionally
`@revision`). Two lookups share these rules:
`resolve_model` (the server's own --model, the CLI: may download) and `find_local_model`
(a name the operator listed for on-demand loading: never the network). `is_path` is the
shape rule every layer uses to tell a path from a served name or a hub id.

Every failure is a one-line `ModelNotFound("model 'X' not found: <reason>")`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.default import DEFAULT_MODEL_NAME, ensure_default_model

# What a model folder needs from a hub snapshot; mirrors mlx_lm.utils' allow list.
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
_PATH_PREFIXES = ("/", ".", "~")  # absolute, ./ ../ (and dot names), home
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path  # local folder holding config.json
    name: str  # id served in /v1/models: folder basename or repo id
    source: str  # resolved local path, or "org/repo@<commit sha>"


def is_repo_id(name: str) -> bool:
    """Whether `name` is shaped like a hub repo id `org/repo` (no revision)."""
    return bool(_REPO_ID.fullmatch(name)) and not name.startswith(_PATH_PREFIXES)


def is_path(name: str) -> bool:
    """Whether a model name is shaped like a file system path (not a served name nor a
    hub id `org/repo`)."""
    return name.startswith(_PATH_PREFIXES) or "\\" in name or name.count("/") > 1


def resolve_model_path(spec: str | None) -> Path:
    return resolve_model(spec).path


def resolve_model(spec: str | None) -> ResolvedModel:
    """None or DEFAULT_MODEL_NAME -> the bundled default; a folder; else a hub repo id.

    A repo id may pin a revision as `org/repo@rev`. Honors `HF_HUB_OFFLINE` at call
    time (huggingface_hub reads it only at import): offline, only the local hub cache
    is consulted.
    """
    if spec is None:
        return _local(ensure_default_model(), name=DEFAULT_MODEL_NAME)
    local = Path(spec).expanduser()
    if local.exists():
        return _local(local, name=local.resolve().name, spec=spec)
    if spec == DEFAULT_MODEL_NAME:
        return _local(ensure_default_model(), name=DEFAULT_MODEL_NAME)
    if (home := _home_folder(spec)) is not None:
        return _local(home, name=spec)
    repo_id, _, revision = spec.partition("@")
    if spec.startswith(_PATH_PREFIXES) or not _REPO_ID.fullmatch(repo_id):
        raise ModelNotFound(f"model '{spec}' not found: no such folder", param="model")
    return _from_hub(spec, repo_id, revision or None)


def find_local_model(name: str) -> ResolvedModel | None:
    """The folder an operator's model name selects (a --model-alias target, an
    --allowed-models entry) without ever touching the network: a local folder, or a
    repo id already in the local hub cache; None if it names neither. Raises
    ModelNotFound for a path-shaped name that is missing or not a model folder. A
    request's own name is never looked up here: what exists on disk is not its business."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith(_PATH_PREFIXES):
        if not (path / "config.json").is_file():
            why = "no config.json in that folder" if path.is_dir() else "no such folder"
            raise ModelNotFound(f"model '{name}' not found: {why}", param="model")
        resolved = path.resolve()
        return ResolvedModel(path=resolved, name=resolved.name, source=str(resolved))
    if (home := _home_folder(name)) is not None:
        return ResolvedModel(path=home.resolve(), name=name, source=str(home.resolve()))
    repo_id, _, revision = name.partition("@")
    if _REPO_ID.fullmatch(repo_id):
        return _cached_hub_model(repo_id, revision or None)
    return None


def _home_folder(name: str) -> Path | None:
    """A model folder `$MLX_PREFIX_HOME/models/<name>` (a bare name: no slash)."""
    from mlx_prefix.models.default import default_models_dir

    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    folder = default_models_dir() / name
    return folder if (folder / "config.json").is_file() else None


def adapter_folder(adapter: str) -> Path:
    """A LoRA adapter folder (holding adapter_config.json), resolved; ModelNotFound else."""
    path = Path(adapter).expanduser()
    if not (path / "adapter_config.json").is_file():
        raise ModelNotFound(
            f"adapter '{adapter}' not found: no adapter_config.json in that folder",
            param="adapters",
        )
    return path.resolve()


def _local(path: Path, *, name: str, spec: str | None = None) -> ResolvedModel:
    label = spec if spec is not None else name
    if not path.is_dir():
        raise ModelNotFound(f"model '{label}' not found: not a folder", param="model")
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"model '{label}' not found: no config.json in {path}", param="model")
    resolved = path.resolve()
    return ResolvedModel(path=resolved, name=name, source=str(resolved))


def _hub_snapshot(repo_id: str, folder: Path) -> ResolvedModel:
    # Snapshot folders are named by commit sha: the source pins the exact weights.
    return ResolvedModel(path=folder, name=repo_id, source=f"{repo_id}@{folder.name}")


def _cached_hub_model(repo_id: str, revision: str | None) -> ResolvedModel | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # local_files_only: the cache is consulted, the Hub never is.
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    if not (folder / "config.json").is_file():
        return None
    return _hub_snapshot(repo_id, folder)


def _from_hub(spec: str, repo_id: str, revision: str | None) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
        )
    except GatedRepoError:
        reason = "the repo is gated (accept its terms and log in with `hf auth login`)"
    except RepositoryNotFoundError:
        reason = "no such repo on the Hugging Face Hub"
    except RevisionNotFoundError:
        reason = f"no revision '{revision}' in the repo"
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        reason = (
            "not a local folder, not in the local Hugging Face cache, "
            "and the Hub is offline or unreachable"
        )
    except HFValidationError:
        reason = "not a local folder nor a valid Hugging Face repo id"
    except Exception as e:  # noqa: BLE001
        # HTTP client errors differ across huggingface_hub versions (requests, httpx,
        # httpx2); whatever the transport raised, the caller gets a one-line ModelNotFound.
        reason = f"cannot reach the Hugging Face Hub ({type(e).__name__})"
    else:
        path = Path(folder)
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"model '{spec}' not found: the repo has no config.json", param="model"
            )
        return _hub_snapshot(repo_id, path)
    raise ModelNotFound(f"model '{spec}' not found: {reason}", param="model")
