"""mlx-prefix serve | generate | cache | pull | ls | rm | ps | launch: the parser,
dispatch and one-line errors.

Text goes to stdout, diagnostics to stderr. Model, cache, disk, engine and server flags
have MLX_PREFIX_* variable fallbacks (see config.py); generate's per-request flags do not.
Errors print one line and exit non-zero (2 for a model that cannot be found or loaded),
a traceback only with --verbose.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from mlx_prefix import __version__
from mlx_prefix.errors import MlxPrefixError, ModelNotFound

from . import cache, generate, launch, models, ps, serve_args
from .cache import cmd_cache
from .generate import cmd_generate
from .launch import cmd_launch
from .models import cmd_ls, cmd_pull, cmd_rm
from .ps import cmd_ps
from .serve import cmd_serve

# command -> (one line for --help, its arguments)
COMMANDS = {
    "serve": ("run the OpenAI-compatible HTTP server", serve_args.add_arguments),
    "generate": ("generate one reply and exit", generate.add_arguments),
    "pull": ("download an MLX model from the Hugging Face Hub", models.add_pull_arguments),
    "ls": ("list the models on this machine", models.add_ls_arguments),
    "rm": ("delete a downloaded model", models.add_rm_arguments),
    "ps": ("show what the running server has loaded", ps.add_arguments),
    "launch": (
        "run a coding agent (claude, codex, opencode, qwen, continue, aider) against a server",
        launch.add_arguments,
    ),
    "cache": ("inspect or clear the disk cache", cache.add_arguments),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line like every other error; the usage itself is under --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-prefix", description="Prompt-caching LLM server and CLI for MLX")
    parser.add_argument("--version", action="version", version=f"mlx-prefix {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (line, add_arguments) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=line, description=line))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv, agent_args = launch.split_agent_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        args.agent_args = agent_args
    elif agent_args:
        args = build_parser().parse_args([*argv, "--", *agent_args])  # argparse's own error
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    from mlx_prefix.platform import startup_line

    print(startup_line(), file=sys.stderr)
    try:
        # Looked up when it runs, so that a test may replace one.
        run = {"serve": cmd_serve, "generate": cmd_generate, "pull": cmd_pull, "ls": cmd_ls,
               "rm": cmd_rm, "ps": cmd_ps, "launch": cmd_launch, "cache": cmd_cache}  # fmt: skip
        return run[args.command](args)
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
