"""The models on this machine (`mlx-prefix ls` / `rm`): model folders in the Hugging Face
cache (what `pull`, huggingface-cli and mlx-lm download into) and in
`$MLX_PREFIX_HOME/models` (the converted default model, folders put there by hand).

What a listing says of a model is read from its files, never by loading weights:
size on disk, quantization (config.json), context length, kind (the cache mlx-lm makes
for it: only attention KV is dense; recurrent state is hybrid; a rotating window is
sliding; a vision tower or sentence-transformers pooling are said besides), and whether
its chat template handles tools and reasoning.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.default import default_models_dir
from mlx_prefix.models.preflight import context_length

_REASONING = re.compile(r"<think>|reasoning_content|enable_thinking|reasoning_effort|thinking")
_TOOLS = re.compile(r"\btools\b|tool_calls")


@dataclass(frozen=True)
class LocalModel:
    name: str  # what --model (or a request's model) takes: a repo id, or a folder name
    path: Path  # the folder holding config.json
    source: str  # "hf-cache" | "home"
    size_bytes: int
    quantization: str | None  # "4-bit", "8-bit", or the checkpoint's float dtype
    kind: str  # dense | hybrid | sliding | unknown (mlx-lm cannot build it)
    vision: bool  # a vision tower in the config (served as text by mlx-lm)
    embedding: bool  # sentence-transformers pooling: an embedding model
    context_length: int | None
    tools: bool  # its chat template renders tools
    reasoning: bool  # its chat template knows reasoning (<think>, enable_thinking...)
    revision: str | None = None  # the hub commit of a cached snapshot

    @property
    def kinds(self) -> str:
        """The kind with what it serves besides text: 'hybrid+vision', 'dense+embedding'."""
        extra = ("+vision" if self.vision else "") + ("+embedding" if self.embedding else "")
        return self.kind + extra


def local_models(hub_cache: str | Path | None = None, home: Path | None = None) -> list[LocalModel]:
    """Every model folder in the hub cache (`hub_cache`, default huggingface_hub's) and
    in `home` (default `$MLX_PREFIX_HOME/models`), sorted by name."""
    found = [*_hub_models(hub_cache), *_home_models(home or default_models_dir())]
    return sorted(found, key=lambda m: (m.name.lower(), m.source))


def find_model(name: str, models: list[LocalModel]) -> LocalModel:
    """The listed model `name` names (its name, its path, or `repo@commit-prefix`)."""
    repo, _, commit = name.partition("@")
    for m in models:
        if name in (m.name, str(m.path)):
            return m
        if commit and m.revision and m.name.partition("@")[0] == repo:
            if len(commit) >= 7 and m.revision.startswith(commit):
                return m
    raise ModelNotFound(f"model '{name}' not found here (see mlx-prefix ls)", param="model")


def remove_model(model: LocalModel, hub_cache: str | Path | None = None) -> None:
    """Delete a listed model: its hub revision (blobs no other revision shares go too),
    or its folder under $MLX_PREFIX_HOME."""
    if model.source == "home":
        shutil.rmtree(model.path)
        return
    from huggingface_hub import scan_cache_dir

    assert model.revision is not None
    scan_cache_dir(hub_cache).delete_revisions(model.revision).execute()


def describe(folder: Path, name: str, source: str, size: int, revision: str | None = None):
    """A LocalModel read from `folder`'s files (None when it holds no config.json)."""
    config = _json(folder / "config.json")
    if not isinstance(config, dict):
        return None
    template = template_text(folder)
    return LocalModel(
        name=name,
        path=folder,
        source=source,
        size_bytes=size,
        quantization=quantization(config),
        kind=cache_kind(config),
        vision=isinstance(config.get("vision_config"), dict),
        embedding=(folder / "modules.json").is_file(),
        context_length=context_length(config),
        tools=renders_tools(template),
        reasoning=knows_reasoning(template),
        revision=revision,
    )


def quantization(config: dict[str, Any]) -> str | None:
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict):
        if isinstance(q.get("bits"), int):
            return f"{q['bits']}-bit"
        return str(q.get("quant_method") or "quantized")
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is None and isinstance(config.get("text_config"), dict):
        dtype = config["text_config"].get("torch_dtype") or config["text_config"].get("dtype")
    return str(dtype) if dtype else None


def cache_kind(config: dict[str, Any]) -> str:
    """dense (attention KV only), hybrid (recurrent state beside it), sliding (a rotating
    window), from the cache mlx-lm makes for the model: the model is built with lazy
    weights (nothing computed or loaded); 'unknown' when mlx-lm cannot build it."""
    try:
        from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache, make_prompt_cache
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        caches = list(make_prompt_cache(model))
    except Exception:  # noqa: BLE001 - any model mlx-lm cannot build from this config
        return "unknown"
    flat: list[Any] = []
    while caches:
        c = caches.pop()
        if isinstance(c, CacheList):
            caches.extend(c.caches)
        else:
            flat.append(c)
    if any(isinstance(c, ArraysCache) for c in flat):
        return "hybrid"
    if any(isinstance(c, RotatingKVCache) for c in flat):
        return "sliding"
    return "dense"


def renders_tools(template: str) -> bool:
    """Whether a chat template's text handles tools (read, not rendered)."""
    return bool(_TOOLS.search(template))


def knows_reasoning(template: str) -> bool:
    """Whether a chat template's text knows reasoning (<think>, enable_thinking...)."""
    return bool(_REASONING.search(template))


def template_text(folder: Path) -> str:
    """The chat template(s) a folder ships: chat_template.jinja, or tokenizer_config's."""
    texts = [p.read_text(errors="replace") for p in sorted(folder.glob("*.jinja"))]
    cfg = _json(folder / "tokenizer_config.json")
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, str):
        texts.append(template)
    elif isinstance(template, list):  # [{"name": ..., "template": ...}]
        texts += [t.get("template", "") for t in template if isinstance(t, dict)]
    return "\n".join(texts)


def _hub_models(hub_cache: str | Path | None) -> list[LocalModel]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache)
    except CacheNotFound:
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        for rev in revisions:
            named = "main" in rev.refs or len(revisions) == 1
            name = repo.repo_id if named else f"{repo.repo_id}@{rev.commit_hash[:12]}"
            model = describe(rev.snapshot_path, name, "hf-cache", rev.size_on_disk, rev.commit_hash)
            if model is not None:
                found.append(model)
    return found


def _home_models(home: Path) -> list[LocalModel]:
    if not home.is_dir():
        return []
    found = []
    for folder in sorted(home.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue  # a conversion in progress (models/default.py) or a stray file
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        model = describe(folder, folder.name, "home", size)
        if model is not None:
            found.append(model)
    return found


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
