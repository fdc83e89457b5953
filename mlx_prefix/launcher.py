"""The `mlx-prefix` console entry point: make sure a fast BLAS is loaded, then run the CLI.

On Linux the command re-executes itself once with the BLAS preloaded (it must be in
place before the process starts). The re-exec is skipped on macOS, when no fast BLAS
is installed, or when it already happened.
"""

from __future__ import annotations

import os
import sys

from mlx_prefix.blas_exec import fast_blas_env
from mlx_prefix.platform import PRELOADED_ENV


def reexec_with_fast_blas(argv: list[str]) -> None:
    """Replace this process with one that preloads a fast BLAS. Returns only if it can't."""
    if os.environ.get(PRELOADED_ENV):
        return
    env = fast_blas_env()
    if PRELOADED_ENV not in env:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, "-m", "mlx_prefix", *argv], env)
    except OSError:
        return


def main() -> None:
    reexec_with_fast_blas(sys.argv[1:])
    from mlx_prefix.cli import main as cli_main

    sys.exit(cli_main(sys.argv[1:]))
