"""A server on several ranks over loopback: `mlx.launch -n N --backend ring` running the
same command a one-process Server runs (mlx-prefix or mlx_lm.server, through
`mlx_prefix.blas_exec`), so both servers of issue 16's comparison share the launcher.

The launcher starts in a session of its own and every rank inherits its process group
(mlx.launch runs each rank as `bash -c '...; exec python ...'`), so stopping signals the
whole group and waits until no process of it is left: no rank outlives its workload and
no port stays taken. mlx.launch polls its ranks' pipes without sleeping, so each running
group's launcher costs a fraction of a core even while idle (both servers pay it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .server_process import Server, ServerFailed, free_port

LAUNCHER = Path(sys.executable).parent / "mlx.launch"
BACKEND = "ring"
STOP_S = 30.0  # SIGTERM to the group, then SIGKILL to what is left


def launcher_problem() -> str | None:
    """Why no group can be launched here (None: the launcher is installed)."""
    return None if LAUNCHER.is_file() else f"no {LAUNCHER}"


def launch_prefix(ranks: int, ring_port: int) -> list[str]:
    return [str(LAUNCHER), "-n", str(ranks), "--backend", BACKEND, "-p", str(ring_port)]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    proc = Path("/proc")
    if not proc.is_dir():  # no /proc (macOS): ask the kernel whether any is left
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            out.append(int(entry.name))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"MLX_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


@dataclass
class ShardedServer(Server):
    """`spec.ranks` ranks of one server under mlx.launch; rank 0 serves HTTP on `port`."""

    ring_port: int = 0

    def launch(self) -> ShardedServer:
        label = self.spec.label or self.spec.name
        problem = launcher_problem()
        if problem is not None:
            raise ServerFailed(f"{label}: cannot launch {self.spec.ranks} ranks: {problem}")
        self.port = free_port()
        self.ring_port = free_port(self.spec.ranks)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_dir / f"{label}-{self.port}.log", "wb")  # noqa: SIM115
        # The one-process argv is [python, -m, mlx_prefix.blas_exec, ...]; the launcher
        # supplies the python.
        argv = self.spec.argv(self.port)
        cmd = [*launch_prefix(self.spec.ranks, self.ring_port), "--python", argv[0], *argv[1:]]
        self.proc = subprocess.Popen(
            cmd,
            # A pipe nobody writes to: the launcher forwards its stdin to every rank.
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        return self

    def rank_pids(self) -> list[int]:
        """The ranks' pids in rank order (Linux /proc; [] where it cannot tell)."""
        if self.proc is None:
            return []
        ranks = {}
        for pid in group_members(self.proc.pid):
            rank = _rank_of(pid)
            if rank is not None and pid != self.proc.pid:
                ranks[rank] = pid
        return [ranks[r] for r in sorted(ranks)]

    @property
    def pid(self) -> int:
        """Rank 0's pid (the launcher's where the ranks cannot be read)."""
        assert self.proc is not None
        return next(iter(self.rank_pids()), self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            pgid = self.proc.pid  # the launcher leads the group (start_new_session)
            for sig, wait_s in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, STOP_S)):
                if not group_members(pgid):
                    break
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while group_members(pgid) and time.monotonic() < deadline:
                    self.proc.poll()  # reap the launcher as soon as it exits
                    time.sleep(0.2)
            self.proc.wait()
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            left = group_members(pgid)
            self.proc = None
            if left:
                raise ServerFailed(f"{self.spec.label or self.name}: ranks {left} survived")
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None
