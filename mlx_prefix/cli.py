"""mlx-prefix serve | generate.

Text goes to stdout, diagnostics to stderr. Model, cache, disk, engine and server flags
have MLX_PREFIX_* variable fallbacks (see config.py); generate's per-request flags do not.
Errors print one line and exit non-zero (2 for a model that cannot be found or loaded),
a traceback only with --verbose.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from mlx_prefix import __version__
from mlx_prefix.config import parse_bytes as config_parse_bytes
from mlx_prefix.errors import MlxPrefixError, ModelNotFound


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9', '1024' -> bytes (argparse type)."""
    try:
        return config_parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _number_type(kind: type, *, lo: float, hi: float, what: str):
    """An argparse type: a `kind` number in [lo, hi]."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not lo <= value <= hi:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what}")
        return value

    return parse


_max_tokens = _number_type(int, lo=1, hi=float("inf"), what="at least 1")
_temperature = _number_type(float, lo=0.0, hi=2.0, what="0 (greedy) to 2")
_top_p = _number_type(float, lo=0.0, hi=1.0, what="0 to 1")
_seed = _number_type(int, lo=0, hi=2**64 - 1, what="0 to 2**64-1")


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
    p.add_argument(
        "--no-prefetch",
        action="store_false",
        dest="prefetch_next_turn",
        default=None,
        help="don't prefill a chat's reply again while idle (next-turn prefetch)",
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


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line like every other error; the usage itself is under --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-prefix", description="Prompt-caching LLM server and CLI for MLX")
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
    gen.add_argument("-n", "--max-tokens", type=_max_tokens, default=256)
    gen.add_argument(
        "-t", "--temp", type=_temperature, default=0.0, help="temperature, 0 to 2 (0 = greedy)"
    )
    gen.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus mass, 0 to 1 (0 = greedy)")
    gen.add_argument("--seed", type=_seed, default=None, help="sampling seed, 0 to 2**64-1")
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

    keys = ("max_running", "max_queued", "prefill_tokens_per_step", "prefetch_next_turn")
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
    from mlx_prefix.engine.session import PrefixCacheSession, chat_prompt
    from mlx_prefix.records import DoneEvent, PromptInput, SamplingParams, TokenEvent

    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if prompt_text is None and args.messages is None:
        raise MlxPrefixError("give a PROMPT, or --messages FILE")
    if args.raw:
        if prompt_text is None:
            raise MlxPrefixError("--raw needs a PROMPT")
        if args.system is not None or args.messages is not None:
            raise MlxPrefixError("--raw completes PROMPT alone: drop --system and --messages")
        prompt = PromptInput(text=prompt_text)
    else:
        messages = _read_messages(args.messages) if args.messages else None
        first = messages[0] if messages else None
        if args.system is not None and isinstance(first, dict) and first.get("role") == "system":
            raise MlxPrefixError(
                f"--system given, but {args.messages} already starts with a system message"
            )
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
    if args.action == "clear":
        # No budget: a scan with a smaller budget than the server's would delete its files.
        disk = DiskCache(config.path(), budget_bytes=None)
        print(f"removed {disk.clear()} cached checkpoints from {config.path()}")
        return 0
    listing = DiskCache.listing(config.path())  # reads headers; changes nothing
    for e in listing.entries:
        if args.json:
            print(json.dumps(dataclasses.asdict(e)))
        else:
            print(
                f"{e.model_key}  {e.tokens:>7} tokens  {e.nbytes / 2**20:>9.1f} MiB  "
                f"{e.kind:<12} idle {e.idle_s:,.0f}s"
            )
    for bad in listing.bad:
        print(f"bad: {bad.name}: {bad.reason} (removed at the next start)", file=sys.stderr)
    total = sum(e.nbytes for e in listing.entries)
    where = config.path() if listing.exists else f"{config.path()} (no such folder)"
    print(
        f"{len(listing.entries)} checkpoints, {total / 2**20:.1f} MiB in {where}", file=sys.stderr
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
        return _error(e.message, 2, args.verbose)
    except (MlxPrefixError, ValueError) as e:
        return _error(getattr(e, "message", str(e)), 1, args.verbose)
    except BrokenPipeError:
        # The reader went away (`| head`): nothing left to say. Point stdout at devnull
        # so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by it
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: one line, not a traceback
        return _error(f"{type(e).__name__}: {e}", 1, args.verbose)
    finally:
        import mlx.core as mx

        mx.clear_streams()  # the model was loaded on this thread: see Engine._loop


def _error(message: str, code: int, verbose: bool) -> int:
    if verbose:
        import traceback

        traceback.print_exc()
    print(f"mlx-prefix: error: {' '.join(message.split())}", file=sys.stderr)
    return code
