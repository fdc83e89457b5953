"""Load a model sharded over the ranks of an `mlx.launch` group, with mlx-lm's own
`sharded_load` (tensor parallel: every layer's heads split by `model.shard`; pipeline
parallel: the layers split by `model.model.pipeline`).

A model that cannot be split that way is refused here, before any weight is read, with
one line: no `shard`/`pipeline` in its mlx-lm class, or head counts the world size does
not divide (mlx-lm's own sharding would split 9 heads into 4.5 and fail at the first
request). After loading, every rank checks that its prompt cache has the same layout as
every other's: rank 0 decides admission and eviction from its own byte counts, which
holds for every rank only if their caches are the same size (always so in tensor mode;
in pipeline mode, an uneven split of layers is refused).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.engine.sharded.group import Channel, Cluster, RankInfo, host_name
from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.load import LoadedModel, finish_loading, tokenizer_config
from mlx_prefix.models.resolve import resolve_model
from mlx_prefix.models.template import ensure_template, template_args

_INDEX = "model.safetensors.index.json"


def load_sharded(
    spec: str | None,
    channel: Channel,
    *,
    pipeline: bool,
    backend: str,
    dtype: str | None = None,
    chat_template: str | None = None,
    use_default_chat_template: bool = False,
    chat_template_args: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[LoadedModel, Cluster]:
    """This rank's shard of `spec`, and the group's layout. Every rank calls it (it runs
    collectives). Raises ModelNotFound (one line) for a model that cannot be sharded.
    The template options are load_model's (models/template.py)."""
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import sharded_load

    defaults = template_args(chat_template_args)
    options = tokenizer_config(chat_template, trust_remote_code)
    resolved = resolve_model(spec)
    label = spec if spec is not None else resolved.name
    mode = "pipeline" if pipeline else "tensor"
    world = channel.size
    refused = f"model '{label}' cannot be served sharded over {world} ranks in {mode} mode"
    try:
        config = json.loads((resolved.path / "config.json").read_text())
        lazy, _ = mlx_lm_load_model(
            resolved.path, lazy=True, strict=False, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # noqa: BLE001 - any failure of a damaged folder: one line
        raise ModelNotFound(f"model '{label}' could not be loaded: {e}", param="model") from e
    reason = shard_refusal(config, lazy, world, pipeline, resolved.path)
    if reason is not None:
        raise ModelNotFound(f"{refused}: {reason}", param="model")
    del lazy
    group = channel.group
    try:
        model, tokenizer, config = sharded_load(
            str(resolved.path),
            pipeline_group=group if pipeline else None,
            tensor_group=None if pipeline else group,
            return_config=True,
            tokenizer_config=options,
            trust_remote_code=trust_remote_code,
        )
        ensure_template(tokenizer, use_default_chat_template)
    except Exception as e:  # noqa: BLE001 - e.g. a dimension mlx's sharded layers refuse
        raise ModelNotFound(f"{refused}: {' '.join(str(e).split())}", param="model") from e
    part = _part(model, config, world, pipeline)
    shard = f"{mode} {channel.rank}/{world}"
    loaded = finish_loading(model, tokenizer, config, resolved, dtype, defaults, shard=shard)
    infos = channel.gather_bytes(json.dumps([host_name(), os.getpid(), part]).encode())
    ranks = tuple(RankInfo(r, *json.loads(b)) for r, b in enumerate(infos))
    check_equal_caches(loaded, channel, refused)
    return loaded, Cluster(channel.rank, world, backend, mode, ranks)


def shard_refusal(
    config: dict[str, Any], model: Any, world: int, pipeline: bool, path: Path
) -> str | None:
    """Why `model` (lazily loaded, config `config`) cannot be split over `world` ranks,
    or None if it can."""
    kind = config.get("model_type", "?")
    if pipeline:
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "pipeline"):
            return f"mlx-lm's {kind} model has no pipeline mode (run without --pipeline)"
        if len(inner.layers) < world:
            return f"{len(inner.layers)} layers cannot be split over {world} ranks"
        if not (path / _INDEX).is_file():
            return f"no {_INDEX} in {path} (mlx_lm.convert writes it)"
        return None
    if not hasattr(model, "shard"):
        return f"mlx-lm's {kind} model cannot split its heads (no shard(); try --pipeline)"
    for cfg in (config, config.get("text_config") or {}):
        for key, value in sorted(cfg.items()):
            if key.endswith("heads") and isinstance(value, int) and value % world:
                return f"{key}={value} is not divisible by {world}"
    return None


def check_equal_caches(loaded: LoadedModel, channel: Channel, refused: str) -> None:
    """Every rank computes a few tokens (in lockstep) and compares its cache's layout with
    the others'; raises ModelNotFound on every rank if they differ."""
    model = loaded.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    mine = zlib.crc32(repr(cache_layout(cache)).encode())
    layouts = channel.gather(mine)
    if len(set(layouts)) > 1:
        raise ModelNotFound(
            f"{refused}: the ranks' prompt caches differ in layout (an uneven split of "
            "layers); rank 0's cache decisions need them equal (use tensor mode)",
            param="model",
        )


def cache_layout(cache: list) -> list[tuple]:
    """Each layer cache's type and its arrays' shapes and dtypes."""
    return [(type(c).__name__, tuple(_shapes(c.state))) for c in cache]


def _shapes(x: Any) -> list[tuple]:
    if isinstance(x, mx.array):
        return [(tuple(x.shape), str(x.dtype))]
    if isinstance(x, (list, tuple)):
        return [s for y in x for s in _shapes(y)]
    return []


def _part(model: Any, config: dict[str, Any], world: int, pipeline: bool) -> str:
    if not pipeline:
        return f"1/{world} of every layer's heads"
    inner = model.model
    first, last = inner.start_idx, inner.end_idx - 1
    total = config.get("num_hidden_layers") or (config.get("text_config") or {}).get(
        "num_hidden_layers", "?"
    )
    return f"layers {first}-{last} of {total}" if last > first else f"layer {first} of {total}"
