"""The `mlx-prefix` console entry point: make sure a fast BLAS is loaded, then run the CLI.

On Linux the command re-executes itself once with the BLAS preloaded (it must be in
place before the process starts). The re-exec is skipped on macOS, when no fast BLAS
is installed, or when it already happened. An environment without an MLX backend wheel
is told which extra to install. The CLI's first stderr line names the backend it runs
(platform.startup_line: cpu and its BLAS, cuda, metal).
"""

from __future__ import annotations

import os
import sys

from mlx_prefix import backend
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


def missing_backend() -> str | None:
    """Why MLX cannot run here, where no backend wheel is installed (Linux: mlx-prefix's
    dependency is plain `mlx`, its backend an extra: mlx_prefix/backend.py); else None."""
    if sys.platform == "darwin" or backend.installed():
        return None
    try:
        import mlx.core  # noqa: F401  (a source build of MLX carries its backend)
    except ImportError as e:
        return (
            f"mlx-prefix: MLX has no backend here ({e}); install one: "
            "pip install 'mlx-prefix[cpu]', or 'mlx-prefix[cuda]' on an NVIDIA GPU "
            "(`make serve` chooses)"
        )
    return None


def main() -> None:
    reexec_with_fast_blas(sys.argv[1:])
    if (problem := missing_backend()) is not None:
        sys.exit(problem)
    from mlx_prefix.cli import main as cli_main

    sys.exit(cli_main(sys.argv[1:]))
