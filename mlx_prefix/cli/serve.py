"""mlx-prefix serve: the OpenAI-compatible HTTP server, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse

from mlx_prefix.config import from_env

from .args import (
    cache_args,
    cache_config,
    disk_args,
    disk_config,
    engine_args,
    engine_config,
    model_args,
    model_from_args,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_args(p)
    cache_args(p)
    disk_args(p, "auto")
    engine_args(p)
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8080)")
    p.add_argument(
        "--allowed-origins",
        nargs="*",
        default=None,
        help="extra CORS origins beyond localhost pages and browser extensions",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--cache-sharing",
        choices=("origin", "global"),
        default=None,
        help="origin (default): each page or extension Origin, and each API key, has its "
        "own prompt cache; clients without an Origin share one. global: one cache for all "
        "(any client can tell from cached_tokens what another sent)",
    )
    p.add_argument(
        "--responses-store",
        type=int,
        default=None,
        metavar="N",
        help="keep the last N /v1/responses answers for previous_response_id (default 1000)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.server.app import ServerSettings, serve

    settings_overrides = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "cache_sharing": args.cache_sharing,
        "responses_store": args.responses_store,
        # -v: serve() sets the mlx_prefix logger from this, so it must say debug too.
        "log_level": "debug" if getattr(args, "verbose", False) else None,
        "allowed_origins": tuple(args.allowed_origins)
        if args.allowed_origins is not None
        else None,
    }
    settings = from_env(ServerSettings, "SERVER", settings_overrides)
    engine = Engine(
        model_from_args(args),
        cache_config(args),
        engine_config(args),
        disk_config=disk_config(args),
    )
    serve(engine, settings)
    return 0
