"""`python -m mlx_prefix.blas_exec CMD [ARGS...]`: run CMD with the fast BLAS preloaded.

Used by `make test` and the benchmarks so that pytest and peer servers get the same
BLAS as the `mlx-prefix` command does.
"""

from __future__ import annotations

import os
import sys

from mlx_prefix.platform import PRELOADED_ENV, find_fast_blas


def fast_blas_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    lib = find_fast_blas()
    if lib is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (lib.path, env.get("LD_PRELOAD", "")) if p)
        env[PRELOADED_ENV] = lib.name
        env.update(dict(lib.extra_env))
    return env


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m mlx_prefix.blas_exec CMD [ARGS...]")
    os.execvpe(sys.argv[1], sys.argv[1:], fast_blas_env())


if __name__ == "__main__":
    main()
