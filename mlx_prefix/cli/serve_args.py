"""mlx-prefix serve's flags (beside the shared groups of args.py) and the ServerSettings
they give: a flag, else its MLX_PREFIX_SERVER_* variable, else the default."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from mlx_prefix.env import from_env

from .args import (
    cache_args,
    disk_args,
    draft_args,
    duration,
    engine_args,
    model_args,
    parse_bytes,
)

if TYPE_CHECKING:
    from mlx_prefix.server.settings import ServerSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_args(p)
    draft_args(p)
    cache_args(p)
    disk_args(p, "auto")
    engine_args(p)
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="port (default 8080; 0: a free one, named in the startup line)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="*",
        default=None,
        help="extra CORS origins beyond localhost pages and browser extensions",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=None,
        metavar="HOST",
        help="Host header names accepted besides localhost, 127.0.0.1, [::1] and the --host "
        "address (DNS rebinding defence): e.g. llm.example.com, .example.com (and its "
        "subdomains), or * for any (behind a proxy that rewrites Host). Bound to 0.0.0.0 "
        "or ::, IP addresses and this machine's own name are accepted too",
    )
    p.add_argument(
        "--ollama",
        nargs="?",
        const="",  # Ollama's own address (ServerSettings)
        default=None,
        metavar="HOST:PORT",
        help="also listen on Ollama's address (127.0.0.1:11434 unless given), for apps "
        "that assume it; refused when something already listens there",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
    )
    p.add_argument(
        "--alias",
        action="append",
        dest="aliases",
        default=None,
        metavar="NAME",
        help="another model name that selects the served model (repeatable)",
    )
    p.add_argument(
        "--strict-model-names",
        action="store_true",
        default=None,
        help="answer an unknown model name with 404 (default: the served model answers it)",
    )
    p.add_argument(
        "--max-models",
        type=int,
        default=None,
        metavar="N",
        help="models (or model+adapter pairs) resident at once, least recently used "
        "unloaded first (default 1: a request naming another model swaps it in)",
    )
    p.add_argument(
        "--keep-alive",
        type=duration,
        default=None,
        metavar="DURATION",
        help="how long a model loaded on demand stays loaded once idle: 5m (default), "
        "30s, 1h, 0 (unload after each request), -1 (until another needs its room)",
    )
    p.add_argument(
        "--model-keep-alive",
        type=duration,
        default=None,
        metavar="DURATION",
        help="the same for the --model one (default -1: it stays)",
    )
    p.add_argument(
        "--models-file",
        default=None,
        metavar="PATH",
        help="per-model settings (aliases, context length, sampling defaults, chat template "
        "kwargs, draft model, KV bits, keep_alive, pinned); default: models.toml in "
        "$MLX_PREFIX_HOME, if there",
    )
    p.add_argument(
        "--model-alias",
        action="append",
        dest="model_aliases",
        default=None,
        metavar="NAME=PATH",
        help="a model name selecting another model folder or cached hub id, loaded on "
        "demand (repeatable)",
    )
    embedding_args(p)
    p.add_argument(
        "--allowed-models",
        nargs="*",
        default=None,
        metavar="PATH_OR_ID",
        help="model folders, cached hub ids or LoRA adapter folders a request may name, "
        "loaded on demand (a request may select only these, the --model, its --alias and "
        "--model-alias names)",
    )
    p.add_argument(
        "--keep-billing-header",
        action="store_true",
        default=None,
        help="render Claude Code's x-anthropic-billing-header system block "
        "(left out by default: it changes between requests and would defeat the cache)",
    )
    images = p.add_argument_group("images in requests (vision models)")
    images.add_argument(
        "--allow-image-urls",
        action="store_true",
        default=None,
        help="fetch http(s) image URLs a request names (public addresses only, no redirects, "
        "size and time bounded); by default a URL is a 400 and images come as base64",
    )
    images.add_argument(
        "--image-max-bytes", type=parse_bytes, help="largest encoded image (default 20MiB)"
    )
    images.add_argument(
        "--image-max-pixels",
        type=int,
        help="largest image, width x height, checked before decoding (default 32,000,000)",
    )
    images.add_argument("--max-images", type=int, help="images per request (default 32)")
    images.add_argument(
        "--max-request-pixels",
        type=int,
        help="all of a request's images together, width x height from their headers, "
        "checked before any is decoded (default 33,177,600: four 3840x2160 screenshots)",
    )
    p.add_argument(
        "--no-explain",
        dest="explain_requests",
        action="store_false",
        default=None,
        help="keep no record of why requests reused what they did (GET /v1/cache/requests, "
        "the dashboard's misses, the per-reason metrics and log lines)",
    )
    sampling = p.add_argument_group("sampling defaults (for requests that leave the field out)")
    sampling.add_argument("--temp", type=float, dest="temperature", help="temperature (0: greedy)")
    sampling.add_argument("--top-p", type=float, help="nucleus sampling top-p (1: off)")
    sampling.add_argument("--top-k", type=int, help="top-k sampling (0: off)")
    sampling.add_argument("--min-p", type=float, help="min-p sampling (0: off)")
    sampling.add_argument(
        "--max-tokens", type=int, dest="default_max_tokens", help="reply length (default 512)"
    )
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
        default=None,
        help="the server's log level (default info; -v means debug)",
    )
    p.add_argument(
        "--cache-sharing",
        choices=("origin", "global"),
        default=None,
        help="origin (default): each page or extension Origin, and each API key, has its "
        "own prompt cache; clients without an Origin share one. global: one cache for all "
        "(any client can tell from cached_tokens what another sent)",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: split the model's layers over the ranks (pipeline parallel) "
        "instead of every layer's heads (tensor parallel, the default)",
    )
    p.add_argument(
        "--responses-store",
        type=int,
        default=None,
        metavar="N",
        help="keep the last N /v1/responses answers for previous_response_id (default 1000)",
    )


def embedding_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("embeddings (/v1/embeddings)")
    g.add_argument(
        "--embedding-model",
        metavar="MODEL",
        help="an embedding model (folder or cached hub id: a decoder such as "
        "Qwen3-Embedding) served on /v1/embeddings beside the chat model",
    )
    g.add_argument(
        "--embedding-alias",
        action="append",
        dest="embedding_aliases",
        default=None,
        metavar="NAME",
        help="another model name that selects the embedding model (repeatable)",
    )
    g.add_argument(
        "--embedding-matryoshka",
        action="store_true",
        default=None,
        help="the embedding model was trained Matryoshka-style (Qwen3-Embedding is): "
        "a request's `dimensions` shortens its vectors (read from config.json's "
        "is_matryoshka / matryoshka_dimensions when present)",
    )


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """Flags, else MLX_PREFIX_SERVER_* variables, else defaults."""
    from mlx_prefix.server.settings import ServerSettings

    overrides = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "cache_sharing": args.cache_sharing,
        "responses_store": args.responses_store,
        **{
            k: getattr(args, k)
            for k in ("temperature", "top_p", "top_k", "min_p", "default_max_tokens")
        },
        # -v: serve() sets the mlx_prefix logger from this, so it must say debug too.
        "log_level": args.log_level or ("debug" if getattr(args, "verbose", False) else None),
        "allowed_origins": tuple(args.allowed_origins)
        if args.allowed_origins is not None
        else None,
        "allowed_hosts": tuple(args.allowed_hosts) if args.allowed_hosts is not None else None,
        "aliases": tuple(args.aliases) if args.aliases is not None else None,
        "strict_model_names": args.strict_model_names,
        "max_models": args.max_models,
        "keep_alive_s": args.keep_alive,
        "model_keep_alive_s": args.model_keep_alive,
        "allowed_models": tuple(args.allowed_models) if args.allowed_models is not None else None,
        "model_aliases": tuple(args.model_aliases) if args.model_aliases is not None else None,
        "keep_billing_header": args.keep_billing_header,
        "allow_image_urls": args.allow_image_urls,
        "image_max_bytes": args.image_max_bytes,
        "image_max_pixels": args.image_max_pixels,
        "max_images": args.max_images,
        "max_request_pixels": args.max_request_pixels,
        "ollama": args.ollama,
        "explain_requests": args.explain_requests,
        "embedding_aliases": tuple(args.embedding_aliases)
        if getattr(args, "embedding_aliases", None) is not None
        else None,
    }
    return from_env(ServerSettings, "SERVER", overrides)
