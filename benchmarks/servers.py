"""The servers a run starts: one process each (server_process.py), or a group of ranks
under mlx.launch (servers_sharded.py); which ones a run can start here."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

from .names import OURS, PEER, PEERS, SERVERS, VLLM
from .peers import vllm_mlx_problem
from .server_process import Server, ServerFailed, ServerSpec, free_port
from .servers_sharded import ShardedServer

__all__ = [
    "OURS", "PEER", "PEERS", "SERVERS", "VLLM", "Server", "ServerFailed", "ServerSpec",
    "free_port", "new_server", "start_all", "ours_help", "has_flag", "unavailable",
]  # fmt: skip

DETERMINISTIC = "--deterministic"  # batch-invariant mode (issue 33)


def new_server(spec: ServerSpec, log_dir: Path) -> Server:
    """A Server for `spec`: one process, or a group of ranks when spec.ranks > 1."""
    if spec.ranks > 1:
        return ShardedServer(spec, log_dir)
    return Server(spec, log_dir)


def start_all(
    specs: list[ServerSpec],
    log_dir: Path,
    optional: tuple[str, ...] = (),
    log: Callable[[str], None] | None = None,
) -> list[Server]:
    """Launch every server at once (their model loads overlap), then wait for each. A
    server named in `optional` that fails to start is stopped and left out (logged);
    any other failure stops them all and raises."""
    servers = [new_server(s, log_dir).launch() for s in specs]
    up = []
    try:
        for s in servers:
            try:
                up.append(s.wait_ready())
            except ServerFailed as e:
                if s.name not in optional:
                    raise
                s.stop()
                if log is not None:
                    log(f"  {s.name} left out of this run: {e}")
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return up


def unavailable(name: str, ranks: int = 1) -> str | None:
    """Why server `name` cannot take part here (None: it can)."""
    if name == VLLM:
        if ranks > 1:
            return "vllm-mlx is compared on one rank only"
        return vllm_mlx_problem()
    return None


@cache
def ours_help() -> str:
    """`mlx-prefix serve --help`, to detect flags other engineers are still adding."""
    out = subprocess.run(
        [sys.executable, "-m", "mlx_prefix", "serve", "--help"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, MLX_PREFIX_BLAS="none"),
    )  # fmt: skip
    return out.stdout


def has_flag(flag: str) -> bool:
    """Whether `mlx-prefix serve` takes `flag` (as a whole word of its --help)."""
    return any(w.strip(",[]") == flag for w in ours_help().split())
