"""`mlx-prefix pull REPO[@REVISION]`: download a model mlx-lm can load into the Hugging
Face cache users already have (where huggingface-cli, mlx-lm and `serve --model REPO`
look), with huggingface-hub.

First the plan (`plan_pull`): the files a model folder needs (models/resolve.py's allow
list), their sizes and which are already here, so the size is said before anything is
downloaded. Then the check that it is a model at all: config.json, `model*.safetensors`
weights, a tokenizer, and a `model_type` mlx-lm has (config.json alone is fetched for
that). A GGUF-only or PyTorch-only repo, or an architecture mlx-lm lacks, is refused
before its weights are downloaded. Then `snapshot_download` of the commit checked, with
its progress bar, and the branch asked for (or `main`) recorded in the cache's refs.

Resumable: files already complete in the cache are never fetched again, and a
connection dropped inside a file resumes with an HTTP Range request (huggingface-hub
retries it). `HF_TOKEN` (or `hf auth login`) is sent as huggingface-hub always does;
`HF_ENDPOINT` points it at a mirror. Every failure is one ModelNotFound line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from mlx_prefix.errors import MlxPrefixError, ModelNotFound
from mlx_prefix.models.resolve import ALLOW_PATTERNS

_TOKENIZERS = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


class NotAnMlxModel(ModelNotFound):
    """The repo exists but mlx-lm cannot load what it holds."""


@dataclass(frozen=True)
class PlannedFile:
    name: str
    size: int | None  # bytes; None when the hub does not say
    cached: bool  # complete in the cache already: not downloaded again


@dataclass(frozen=True)
class PullPlan:
    repo_id: str
    revision: str | None  # as asked (None: the default branch)
    commit: str  # what it resolves to
    files: tuple[PlannedFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)

    @property
    def download_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files if not f.cached)


def split_name(spec: str) -> tuple[str, str | None]:
    """'org/repo@rev' -> ('org/repo', 'rev'); ModelNotFound for what is not a repo id."""
    from mlx_prefix.models.resolve import is_repo_id

    repo_id, _, revision = spec.partition("@")
    if not is_repo_id(repo_id) or (revision == "" and spec.endswith("@")):
        raise ModelNotFound(
            f"'{spec}' is not a Hugging Face repo id: pull takes ORG/NAME[@REVISION]",
            param="model",
        )
    return repo_id, revision or None


def plan_pull(repo_id: str, revision: str | None) -> PullPlan:
    """What pulling would download (nothing is downloaded)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    label = f"{repo_id}@{revision}" if revision else repo_id
    # Asked first, alone: its errors say what is wrong (no such repo, revision, access).
    info = _hub_call(label, revision, lambda: HfApi().repo_info(repo_id, revision=revision))
    commit = info.sha
    disable_progress_bars()  # a dry run: nothing to watch
    try:
        infos = _hub_call(
            label,
            revision,
            lambda: snapshot_download(
                repo_id, revision=commit, allow_patterns=ALLOW_PATTERNS, dry_run=True
            ),
        )
    finally:
        enable_progress_bars()
    files = tuple(PlannedFile(i.filename, i.file_size, not i.will_download) for i in infos)
    return PullPlan(repo_id, revision, commit, files)


def check_loadable(plan: PullPlan) -> None:
    """NotAnMlxModel unless the plan's files make a folder mlx-lm can load; fetches
    config.json (only) to read its model_type."""
    from huggingface_hub import hf_hub_download

    label = f"{plan.repo_id}@{plan.revision}" if plan.revision else plan.repo_id
    names = {f.name for f in plan.files}

    def refuse(why: str) -> NotAnMlxModel:
        return NotAnMlxModel(f"'{label}' is not a model mlx-lm can load: {why}", param="model")

    if "config.json" not in names:
        ggufs = " (it holds GGUF files: llama.cpp's format)" if _has_gguf(plan) else ""
        raise refuse(f"no config.json{ggufs}")
    if not any(fnmatch(n, "model*.safetensors") for n in names):
        raise refuse("no model*.safetensors weights (PyTorch .bin or GGUF only?)")
    if not any(n in names for n in _TOKENIZERS):
        raise refuse("no tokenizer file")
    path = _hub_call(
        label,
        plan.revision,
        lambda: hf_hub_download(plan.repo_id, "config.json", revision=plan.commit),
    )
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        raise refuse("its config.json is not JSON") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise refuse("its config.json names no model_type")
    try:
        from mlx_lm.utils import _get_classes

        _get_classes(config)
    except (ValueError, ImportError):
        raise refuse(f"mlx-lm has no '{config['model_type']}' architecture") from None


def pull(plan: PullPlan, progress: bool = True) -> Path:
    """Download the plan's files (those not cached); the snapshot folder. Always the
    commit the plan checked (a branch asked again could have moved since), then the
    branch or tag asked for (the default branch: `main`) recorded as pointing at it
    (`record_ref`), so the cache finds the model by name offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    label = f"{plan.repo_id}@{plan.revision}" if plan.revision else plan.repo_id
    if not progress:
        disable_progress_bars()
    try:
        folder = _hub_call(
            label,
            plan.revision,
            lambda: snapshot_download(
                plan.repo_id, revision=plan.commit, allow_patterns=ALLOW_PATTERNS
            ),
        )
    finally:
        if not progress:
            enable_progress_bars()
    snapshot = Path(folder)
    record_ref(snapshot, plan.revision or constants.DEFAULT_REVISION, plan.commit)
    return snapshot


def record_ref(snapshot: Path, revision: str, commit: str) -> None:
    """`refs/<revision>` in the repo's cache folder (the snapshot's grandparent), holding
    `commit`, as huggingface-hub writes it when it downloads by branch or tag (its
    `_cache_commit_hash_for_specific_revision`, which it does not export): nothing for
    a revision that is the commit itself, an atomic replace otherwise. Without it a
    download by commit is found only by commit: `snapshot_download(local_files_only=
    True)` of the bare repo id (`serve --model` with HF_HUB_OFFLINE, --allowed-models,
    models.toml, launch) reads refs/main."""
    if revision == commit:
        return
    ref = snapshot.parent.parent / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if ref.is_file() and ref.read_text() == commit:
        return
    temporary = ref.with_name(f"{ref.name}.{os.getpid()}.tmp")
    temporary.write_text(commit)
    os.replace(temporary, ref)


def _has_gguf(plan: PullPlan) -> bool:
    from huggingface_hub import list_repo_files

    try:
        return any(n.endswith(".gguf") for n in list_repo_files(plan.repo_id, revision=plan.commit))
    except Exception:  # noqa: BLE001 - only a hint for the message
        return False


def _hub_call(label: str, revision: str | None, call: Callable[[], Any]) -> Any:
    """`call()`, its hub failures as one line each."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DryRunError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return call()
    except GatedRepoError:
        reason = "the repo is gated: accept its terms on the Hub, then set HF_TOKEN"
    except RepositoryNotFoundError:
        reason = "no such repo on the Hugging Face Hub (a private one needs HF_TOKEN)"
    except RevisionNotFoundError:
        reason = f"no revision '{revision}' in the repo"
    except OfflineModeIsEnabled:
        reason = "HF_HUB_OFFLINE is set: pull needs the Hub"
    except (LocalEntryNotFoundError, DryRunError):
        reason = f"cannot reach the Hugging Face Hub at {constants.ENDPOINT}"
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        reason = f"the Hub answered HTTP {status}"
    except MlxPrefixError:
        raise
    except OSError as e:  # a connection that kept failing, a full disk
        reason = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the transport's own errors differ by version
        reason = f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({type(e).__name__})"
    raise ModelNotFound(f"model '{label}' could not be pulled: {reason}", param="model")
