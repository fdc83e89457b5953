"""mlx-prefix serve: the OpenAI-compatible HTTP server, until SIGINT/SIGTERM. Started by
`mlx.launch` on several ranks, it serves a model sharded over them (cli/sharded.py).

Its flags and the ServerSettings they give: cli/serve_args.py. Here: the settings file
read and sharded-only flags refused before any model loads, Ollama's port bound, the
engine and the --embedding-model loaded, then the server run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from mlx_prefix.env import from_env
from mlx_prefix.errors import InvalidRequest

from .args import cache_config, disk_config, draft_from_args, engine_config, model_from_args
from .serve_args import server_settings

if TYPE_CHECKING:
    from mlx_prefix.server.settings import ServerSettings


def cmd_serve(args: argparse.Namespace) -> int:
    from mlx_prefix.config import ModelConfig
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.models.settings_file import load_models_file
    from mlx_prefix.server.app import serve

    from .loader import engine_loader, find_settings, with_settings
    from .sharded import launched_group, serve_sharded

    settings = server_settings(args)
    models_file = load_models_file(args.models_file)  # a bad file stops here, by its line
    group = launched_group()
    if group is not None:
        if args.models_file is not None:
            raise InvalidRequest("--models-file needs an unsharded server")
        if settings.max_models > 1 or settings.model_aliases or settings.allowed_models:
            raise InvalidRequest(
                "--max-models > 1, --model-alias and --allowed-models need an unsharded server"
            )
        if embedding_config(args).embedding_model is not None:
            raise InvalidRequest("--embedding-model needs an unsharded server")
        return serve_sharded(args, group, settings)
    if args.pipeline:
        raise InvalidRequest(
            "--pipeline needs a sharded launch: mlx.launch -n 2 --backend ring "
            "--python <venv>/bin/python -m mlx_prefix serve --model M --pipeline"
        )
    # Ollama's port before the model loads: a server that cannot have it stops at once.
    ollama_socket = ollama_port(settings)
    # No local name for the engine: the server owns it and may unload it.
    model = model_from_args(args)
    named = from_env(ModelConfig, "MODEL", {"model": args.model}).model
    own = find_settings(models_file, named, model.name, str(model.path))
    model, config, draft = with_settings(model, own, engine_config(args))
    embeddings = embedding_worker(args)
    serve(
        Engine(
            model,
            cache_config(args),
            config,
            disk_config=disk_config(args),
            draft=draft or draft_from_args(args, model),
        ),
        settings,
        engine_loader(args, models_file),
        embeddings,
        models_file,
        ollama_socket,
    )
    return 0


def ollama_port(settings: ServerSettings) -> Any:
    """With --ollama, the socket bound to Ollama's address (None without, or when --host
    and --port already are that address)."""
    from mlx_prefix.server.ollama_port import bind_ollama_port, covered

    if not settings.ollama or covered(settings.host, settings.port, settings.ollama):
        return None
    return bind_ollama_port(settings.ollama)


def embedding_config(args: argparse.Namespace) -> Any:
    from mlx_prefix.config import ModelConfig

    keys = ("embedding_model", "embedding_matryoshka", "dtype")
    return from_env(ModelConfig, "MODEL", {k: getattr(args, k, None) for k in keys})


def embedding_worker(args: argparse.Namespace) -> Any:
    """The --embedding-model (in --dtype, else float32 on CPU), on its worker thread
    (None without the flag). Its weights must fit the memory the chat model left, the
    check the model pool makes before loading another model; once loaded they are part
    of what every later check sees as taken."""
    from mlx_prefix.embeddings.model import load_embedding_model
    from mlx_prefix.embeddings.worker import EmbeddingWorker
    from mlx_prefix.models.preflight import load_estimate
    from mlx_prefix.models.resolve import resolve_model
    from mlx_prefix.platform import available_memory
    from mlx_prefix.server.served.loading import InsufficientMemory

    cfg = embedding_config(args)
    if cfg.embedding_model is None:
        return None
    import mlx.core as mx

    folder = resolve_model(cfg.embedding_model).path
    need = load_estimate(folder, None, mx.default_device() == mx.cpu)
    free = available_memory()
    if free is not None and need > free:
        raise InsufficientMemory(
            f"embedding model '{cfg.embedding_model}' needs about {need / 2**30:.1f} GiB for "
            f"its weights; {free / 2**30:.1f} GiB are available beside the chat model"
        )
    model = load_embedding_model(
        cfg.embedding_model, dtype=cfg.dtype, matryoshka=cfg.embedding_matryoshka
    )
    return EmbeddingWorker(model)
