"""mlx-prefix serve | generate.

Text goes to stdout, diagnostics to stderr. Every flag has an MLX_PREFIX_* variable
fallback (see config.py). Errors print one line and exit non-zero (2 for a model that
cannot be found), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from mlx_prefix import __version__
from mlx_prefix.errors import MlxPrefixError, ModelNotFound

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9', '1024' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        help="local model folder or Hugging Face repo id "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--adapter", help="LoRA adapter folder")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="weights dtype (default: float32 on CPU, the checkpoint's on GPU)",
    )


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-budget",
        type=parse_bytes,
        dest="budget_bytes",
        help="bytes for cached snapshots plus running requests (default 4GiB)",
    )
    p.add_argument("--cache-max-entries", type=int, dest="max_entries")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        dest="prefill_chunk",
        help="prefill chunk size; chunk boundaries fall on its multiples (256)",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        dest="checkpoint_interval",
        help="periodic checkpoint every N tokens of long prompts (2048)",
    )
    p.add_argument(
        "--no-cache",
        action="store_false",
        dest="enabled",
        default=None,
        help="disable the prefix cache",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-running", type=int, help="requests decoding together in one batch (default 8)"
    )
    p.add_argument(
        "--max-queued",
        type=int,
        help="waiting requests beyond this get a 429 busy error (default 64)",
    )
    p.add_argument(
        "--prefill-tokens-per-step",
        type=int,
        help="prefill tokens computed between two decode steps (default 256)",
    )


def _disk_args(p: argparse.ArgumentParser, default_scope: str) -> None:
    p.add_argument(
        "--disk-cache",
        dest="scope",
        default=None,
        help=f"what to persist: off (no disk tier) | full | auto[:N] | N (default {default_scope})",
    )
    p.add_argument(
        "--cache-dir",
        dest="directory",
        default=None,
        help="disk cache folder (default: <user cache dir>/mlx-prefix/prompt-cache)",
    )
    p.add_argument(
        "--disk-budget",
        type=parse_bytes,
        dest="disk_budget_bytes",
        default=None,
        help="bytes of disk for cached checkpoints (default 16GiB)",
    )
    p.set_defaults(default_scope=default_scope)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-prefix", description="Prompt-caching LLM server and CLI for MLX"
    )
    parser.add_argument("--version", action="version", version=f"mlx-prefix {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _model_args(serve)
    _cache_args(serve)
    _disk_args(serve, "auto")
    _engine_args(serve)
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8080)")
    serve.add_argument(
        "--allowed-origins",
        nargs="*",
        default=None,
        help="extra CORS origins beyond localhost pages and browser extensions",
    )
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")

    gen = sub.add_parser("generate", help="generate one reply and exit")
    gen.add_argument("prompt", nargs="?", help="the user message (or - for stdin)")
    _model_args(gen)
    _cache_args(gen)
    # One request per process: `auto` would have no earlier request to compare with, so
    # generate persists every checkpoint and a second run with the same --system hits.
    _disk_args(gen, "full")
    gen.add_argument("-s", "--system", help="system prompt")
    gen.add_argument("--messages", type=Path, help="OpenAI messages JSON file (array)")
    gen.add_argument("-n", "--max-tokens", type=int, default=256)
    gen.add_argument("-t", "--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="complete PROMPT as raw text, no template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    cache = sub.add_parser("cache", help="inspect or clear the disk cache")
    cache.add_argument("action", choices=["ls", "clear"])
    cache.add_argument("--cache-dir", dest="directory", default=None)
    cache.add_argument("--json", action="store_true", help="ls: one JSON object per line")
    return parser


def _disk_config(args: argparse.Namespace):
    from mlx_prefix.config import DiskConfig, from_env

    overrides = {
        "scope": args.scope,
        "directory": args.directory,
        "budget_bytes": args.disk_budget_bytes,
    }
    config = from_env(DiskConfig, "DISK", overrides)
    if args.scope is None and "MLX_PREFIX_DISK_SCOPE" not in os.environ:
        config = dataclasses.replace(config, scope=args.default_scope)
    return config


def _cache_config(args: argparse.Namespace):
    from mlx_prefix.config import CacheConfig, from_env

    keys = ("enabled", "budget_bytes", "max_entries", "prefill_chunk", "checkpoint_interval")
    return from_env(CacheConfig, "CACHE", {k: getattr(args, k, None) for k in keys})


def _engine_config(args: argparse.Namespace):
    from mlx_prefix.config import EngineConfig, from_env

    keys = ("max_running", "max_queued", "prefill_tokens_per_step")
    return from_env(EngineConfig, "ENGINE", {k: getattr(args, k, None) for k in keys})


def _load(args: argparse.Namespace):
    from mlx_prefix.config import ModelConfig, from_env
    from mlx_prefix.models.load import load_model

    cfg = from_env(
        ModelConfig, "MODEL", {"model": args.model, "adapter": args.adapter, "dtype": args.dtype}
    )
    return load_model(cfg.model, adapter=cfg.adapter, dtype=cfg.dtype)


def _read_messages(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxPrefixError(f"cannot read messages from {path}: {e}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list):
        raise MlxPrefixError(f"{path}: expected a JSON array of messages")
    return data


def cmd_generate(args: argparse.Namespace) -> int:
    from mlx_prefix.engine.request import DoneEvent, PromptInput, SamplingParams, TokenEvent
    from mlx_prefix.engine.session import PrefixCacheSession, chat_prompt

    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if prompt_text is None and args.messages is None:
        raise MlxPrefixError("give a PROMPT, or --messages FILE")
    if args.raw:
        if prompt_text is None:
            raise MlxPrefixError("--raw needs a PROMPT")
        prompt = PromptInput(text=prompt_text)
    else:
        messages = _read_messages(args.messages) if args.messages else None
        prompt = chat_prompt(prompt_text, system=args.system, messages=messages)
    sampling = SamplingParams(args.max_tokens, args.temp, args.top_p, args.seed, tuple(args.stop))
    session = PrefixCacheSession(
        _load(args), cache_config=_cache_config(args), disk_config=_disk_config(args)
    )
    with session:
        parts = []
        for event in session.stream(prompt, sampling):
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                if not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, DoneEvent):
                u = event.usage
                if args.json:
                    print(
                        json.dumps(
                            {
                                "text": "".join(parts),
                                "finish_reason": event.finish_reason,
                                "usage": dataclasses.asdict(u),
                            }
                        )
                    )
                else:
                    sys.stdout.write("\n")
                print(
                    f"prompt_tokens={u.prompt_tokens} cached_tokens={u.cached_tokens} "
                    f"completion_tokens={u.completion_tokens} ttft={u.ttft_s * 1000:.0f}ms "
                    f"prefill={u.prefill_tokens_per_s:.1f}tok/s "
                    f"decode={u.decode_tokens_per_s:.1f}tok/s finish={event.finish_reason}",
                    file=sys.stderr,
                )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.server.app import ServerSettings, serve

    settings_overrides = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "allowed_origins": tuple(args.allowed_origins)
        if args.allowed_origins is not None
        else None,
    }
    from mlx_prefix.config import from_env

    settings = from_env(ServerSettings, "SERVER", settings_overrides)
    engine = Engine(
        _load(args), _cache_config(args), _engine_config(args), disk_config=_disk_config(args)
    )
    serve(engine, settings)
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from mlx_prefix.cache.disk import DiskCache
    from mlx_prefix.config import DiskConfig, from_env

    config = from_env(DiskConfig, "DISK", {"directory": args.directory})
    # No budget: a scan with a smaller budget than the server's would delete its files.
    disk = DiskCache(config.path(), budget_bytes=None)
    if args.action == "clear":
        print(f"removed {disk.clear()} cached checkpoints from {config.path()}")
        return 0
    entries = disk.entries()
    for e in entries:
        if args.json:
            print(json.dumps(dataclasses.asdict(e)))
        else:
            print(
                f"{e.model_key}  {e.tokens:>7} tokens  {e.nbytes / 2**20:>9.1f} MiB  "
                f"{e.kind:<12} idle {e.idle_s:,.0f}s"
            )
    total = sum(e.nbytes for e in entries)
    print(
        f"{len(entries)} checkpoints, {total / 2**20:.1f} MiB in {config.path()}", file=sys.stderr
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    from mlx_prefix.platform import startup_line

    print(startup_line(), file=sys.stderr)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "cache":
            return cmd_cache(args)
        return cmd_serve(args)
    except ModelNotFound as e:
        print(f"mlx-prefix: error: {e.message}", file=sys.stderr)
        return 2
    except (MlxPrefixError, ValueError) as e:
        print(f"mlx-prefix: error: {getattr(e, 'message', e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        import mlx.core as mx

        mx.clear_streams()  # the model was loaded on this thread: see Engine._loop
