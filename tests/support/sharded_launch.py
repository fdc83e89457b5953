"""Start `mlx-prefix serve` on 2 ranks over loopback (ring backend) for the sharded tests:
through `mlx.launch`, or rank by rank as `mlx.launch` does (a hostfile, MLX_RANK) when a
test needs each rank's own exit code. Skips, with the reason, where mlx.launch cannot
run a 2-rank all_sum on this machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from benchmarks.servers import free_port
from support.paths import REPO
from support.served_process import SERVING

LAUNCHER = Path(sys.executable).parent / "mlx.launch"
START_S = 300.0  # two ranks importing MLX, loading and probing on 2 busy cores
_PROBE = "import mlx.core as mx\nprint(mx.distributed.all_sum(mx.array([1.0])).item())\n"
_checked: list[str | None] = []


def require_launcher() -> None:
    """Skip unless `mlx.launch -n 2 --backend ring` runs an all_sum here (checked once)."""
    if not _checked:
        _checked.append(_launcher_problem())
    if _checked[0] is not None:
        pytest.skip(f"mlx.launch cannot run 2 ranks here: {_checked[0]}")


def _launcher_problem(tries: int = 3) -> str | None:
    """Why a 2-rank all_sum cannot run here (None: it can). Tried up to `tries` times,
    each on fresh ports: one failed start (a port taken between the check and the
    launch, a loaded machine) must not skip every sharded test of a run."""
    if not LAUNCHER.is_file():
        return f"no {LAUNCHER}"
    problem = None
    for _ in range(tries):
        problem = _try_all_sum()
        if problem is None:
            return None
    return problem


def _try_all_sum() -> str | None:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_PROBE)
    cmd = [str(LAUNCHER), "-n", "2", "--backend", "ring", "-p", str(free_port(2))]
    try:
        out = subprocess.run(
            [*cmd, "--python", sys.executable, f.name], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "a 2-rank all_sum did not finish in 120 s"
    finally:
        os.unlink(f.name)
    if out.stdout.split() != ["2.0", "2.0"]:
        return f"a 2-rank all_sum printed {out.stdout!r} {out.stderr[-300:]!r}"
    return None


@dataclass
class Group:
    url: str  # rank 0's, once its startup line named the port
    procs: list[subprocess.Popen]  # the launcher, or each rank
    log: Path
    rank_pids: list[int] = field(default_factory=list)  # read once it serves

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> list[int]:
        """Every rank's pid, from /v1/cache's layout."""
        stats = httpx.get(f"{self.url}/v1/cache", timeout=30).json()["stats"]
        return [r["pid"] for r in stats["distributed"]["ranks"]]

    def stop(self) -> list[int | None]:
        """SIGTERM to rank 0: it shuts the group down (the others follow its stop)."""
        os.kill(self.rank_pids[0], signal.SIGTERM)
        return self.wait(90)

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "MLX_PREFIX_SERVER_LOG_LEVEL": "info"}


def _serve_args(model: Path, extra: list[str]) -> list[str]:
    # --port 0: rank 0 binds a free port and names it in its startup line (SERVING).
    return ["-m", "mlx_prefix", "serve", "--model", str(model), "--port", "0", *extra]


@contextmanager
def launched(model: Path, tmp: Path, *extra: str, by_hand: bool = False) -> Iterator[Group]:
    """A 2-rank server of `model` (extra serve flags after it); stopped on leaving."""
    require_launcher()
    ring = free_port(2)  # the ring backend's ports must be named; HTTP's is rank 0's pick
    log = tmp / f"group-{ring}.log"
    args = _serve_args(model, list(extra))
    with log.open("wb") as out:
        if by_hand:
            hostfile = tmp / f"hosts-{ring}.json"
            hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
            procs = [
                subprocess.Popen(
                    [sys.executable, *args],
                    env={**_env(), "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
                for rank in (0, 1)
            ]
        else:
            cmd = [str(LAUNCHER), "-n", "2", "--backend", "ring", "-p", str(ring)]
            cmd += ["--python", sys.executable, *args]
            procs = [subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT)]
    group = Group("", procs, log)
    try:
        _wait_healthy(group)
        group.rank_pids = group.pids()
        yield group
    finally:
        _end(group)


def launch_exits(model: Path, tmp: Path, *extra: str) -> tuple[int, str]:
    """Run a group that is expected to stop by itself: rank 0's exit code and the log."""
    require_launcher()
    ring = free_port(2)
    hostfile = tmp / f"hosts-{ring}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring}"], [f"127.0.0.1:{ring + 1}"]]))
    args = _serve_args(model, list(extra))
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env={**_env(), "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=START_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs[0].returncode, "\n".join(outs)


def _wait_healthy(group: Group) -> None:
    """Wait for rank 0's startup line (it names the port), then for /health."""
    deadline = time.monotonic() + START_S
    while True:
        if not group.url and (found := SERVING.search(group.text())):
            group.url = f"http://127.0.0.1:{found.group(1)}"
        try:
            if group.url and httpx.get(f"{group.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if any(p.poll() is not None for p in group.procs) or time.monotonic() > deadline:
            raise AssertionError(f"the sharded server did not start:\n{group.text()[-3000:]}")
        time.sleep(1)


def _end(group: Group) -> None:
    if any(p.poll() is None for p in group.procs) and group.rank_pids:
        try:
            group.stop()
        except OSError:  # rank 0 is gone already
            pass
    if any(p.poll() is None for p in group.procs):  # the launcher still waits on them
        for pid in group.rank_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for p in group.procs:
        if p.poll() is None:
            p.kill()
        p.wait()
