"""How `serve` loads a model, at startup and on demand: the model flags, then the model's
table in the settings file (models/settings_file.py) over them: its context length,
chat-template kwargs, KV bits and draft model. The pool (server/served/pool.py) calls
the loader on a thread of its own; sampling defaults, aliases, keep-alive and pins are
the server's business (server/routes/common.py, server/served/idle.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from mlx_prefix.config import EngineConfig, ModelConfig
from mlx_prefix.env import from_env
from mlx_prefix.models.settings_file import NO_SETTINGS, ModelSettings, ModelsFile

from .args import cache_config, disk_config, engine_config

if TYPE_CHECKING:
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.models.load import LoadedModel
    from mlx_prefix.server.served.loading import EngineLoader
    from mlx_prefix.server.served.names import ModelSpec

log = logging.getLogger("mlx_prefix.server")


def with_settings(
    model: LoadedModel, own: ModelSettings, config: EngineConfig
) -> tuple[LoadedModel, EngineConfig, LoadedModel | None]:
    """`model` and the engine config with `own`'s settings applied, and its draft model
    (loaded in the model's dtype; None without one)."""
    from mlx_prefix.models.load import load_model

    if own.context_length is not None:
        model.context_length = own.context_length
    if own.chat_template_kwargs:
        model.template_args = {**model.template_args, **own.chat_template_kwargs}
    config = dataclasses.replace(
        config,
        kv_bits=config.kv_bits if own.kv_bits is None else own.kv_bits,
        kv_group_size=config.kv_group_size if own.kv_group_size is None else own.kv_group_size,
    )
    draft = None
    if own.draft_model is not None:
        draft = load_model(own.draft_model, dtype=model.identity.dtype)
    if own is not NO_SETTINGS:
        log.info("model %s: settings from the settings file's [models.%r]", model.name, own.name)
    return model, config, draft


def find_settings(models_file: ModelsFile, *names: str | None) -> ModelSettings:
    """The table of the first of `names` the file names (NO_SETTINGS if none)."""
    for name in names:
        if name and (found := models_file.find(name)) is not None:
            return found
    return NO_SETTINGS


def engine_loader(args: argparse.Namespace, models_file: ModelsFile) -> EngineLoader:
    """How the server loads a model on demand (server/served/pool.py): the model flags,
    except that --chat-template applies to the default model only, the cache and
    engine flags, then the model's settings; the engine shares the store and disk
    cache it is given."""
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.models.load import load_model

    keys = ("model", "dtype", "chat_template", "use_default_chat_template",
            "chat_template_args", "trust_remote_code", "draft_model")  # fmt: skip
    cfg = from_env(ModelConfig, "MODEL", {k: getattr(args, k, None) for k in keys})

    def load(spec: ModelSpec, store: Any, disk_cache: Any) -> Engine:
        model = load_model(
            cfg.model if spec.default else str(spec.folder),
            adapter=str(spec.adapter) if spec.adapter else None,
            dtype=cfg.dtype,
            chat_template=cfg.chat_template if spec.default else None,
            use_default_chat_template=cfg.use_default_chat_template,
            chat_template_args=cfg.chat_template_args,
            trust_remote_code=cfg.trust_remote_code,
        )
        names = (cfg.model, model.name, str(model.path)) if spec.default else (spec.id,)
        own = find_settings(models_file, *names)
        model, config, draft = with_settings(model, own, engine_config(args))
        if draft is None and spec.default and cfg.draft_model is not None:
            draft = load_model(cfg.draft_model, dtype=model.identity.dtype)
        return Engine(
            model,
            cache_config(args),
            config,
            store=store,
            disk_config=disk_config(args),
            disk_cache=disk_cache,
            draft=draft,
        )

    return load
