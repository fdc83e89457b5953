"""One server subprocess on a free loopback port: mlx-prefix, mlx_lm.server or vllm-mlx.

Each is spawned through `python -m mlx_prefix.blas_exec`, which execs the server with
the fast BLAS preloaded (LD_PRELOAD on Linux), so the PID we hold is the server's own.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .names import MLX_VLM, OURS, VLLM
from .peers import VENV, vllm_mlx_command


def loaded_blas(pid: int) -> str | None:
    """The BLAS a running process has mapped (Linux /proc), None if unreadable."""
    from mlx_prefix.platform import blas_in_maps

    try:
        return blas_in_maps(Path(f"/proc/{pid}/maps").read_text())
    except OSError:
        return None


class ServerFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerSpec:
    name: str  # OURS, PEER or VLLM (a peer-cold reference is PEER with no cache)
    model: Path
    extra_args: tuple[str, ...] = ()
    label: str = ""  # for logs: "ours", "peer", "peer-cold"
    ranks: int = 1  # above 1: one group of ranks under mlx.launch (servers_sharded.py)
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment

    def argv(self, port: int) -> list[str]:
        py = sys.executable
        if self.name == OURS:
            cmd = [py, "-m", "mlx_prefix", "serve", "--model", str(self.model)]
            if "--cache-dir" not in self.extra_args:
                # Memory only, like the peer, and never a hit from an earlier run's files.
                cmd += ["--disk-cache", "off"]
        elif self.name == VLLM:
            cmd = [str(vllm_mlx_command()), "serve", str(self.model), "--continuous-batching"]
            cmd += ["--host", "127.0.0.1"]
        elif self.name == MLX_VLM:
            python = str(VENV / "bin" / "python")  # peers.mlx_vlm_problem says why there
            cmd = [python, "-m", "mlx_vlm.server", "--model", str(self.model)]
            cmd += ["--host", "127.0.0.1", "--log-level", "WARNING"]
        else:
            cmd = [py, "-m", "mlx_lm.server", "--model", str(self.model), "--log-level", "WARNING"]
        return [py, "-m", "mlx_prefix.blas_exec", *cmd, "--port", str(port), *self.extra_args]

    @property
    def request_model(self) -> str | None:
        """The `model` a request must name (None: the server's default is used)."""
        return str(self.model) if self.name in (VLLM, MLX_VLM) else None

    @property
    def own_home(self) -> bool:
        """Whether the process gets an empty HOME of its own: vllm-mlx saves its prefix
        cache under ~/.cache/vllm-mlx at exit and loads it at start, and no server may
        start with a hit from an earlier run's files."""
        return self.name in (VLLM, MLX_VLM)


def free_port(span: int = 1) -> int:
    """A loopback port p with p .. p+span-1 free now (the ring backend listens on one per
    rank). The tests' launches (tests/support/sharded_launch.py) take theirs here too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span <= 65536 and all(_bindable(port + i) for i in range(1, span)):
            return port
    raise ServerFailed(f"no free range of {span} loopback ports")


def stop_process(proc: subprocess.Popen | None, timeout: float = 20) -> None:
    """Ends a server process still running: SIGTERM, then SIGKILL after `timeout`."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Server:
    """One running server process. `start` blocks until /health answers."""

    spec: ServerSpec
    log_dir: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)
    _home: Path | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def request_model(self) -> str | None:
        return self.spec.request_model

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def launch(self) -> Server:
        self.port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        label = self.spec.label or self.spec.name
        self._log = open(self.log_dir / f"{label}-{self.port}.log", "wb")  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(self.spec.env))
        if self.spec.own_home:
            self._home = Path(tempfile.mkdtemp(prefix=f"bench-{label}-home-"))
            env["HOME"] = str(self._home)
        self.proc = subprocess.Popen(
            self.spec.argv(self.port), stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> Server:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(
                    f"{self.spec.label or self.name} exited ({self.proc.returncode});"
                    f" see {self._log.name}"
                )  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self._warm_up()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ServerFailed(f"{self.spec.label or self.name} not ready after {timeout_s:.0f}s")

    def _warm_up(self) -> None:
        # The first request pays one-time costs (lazy init, kernel set-up); keep it out of
        # every workload. A raw completion shares no chat-template prefix with workloads.
        body: dict = {"prompt": "Warm up.", "max_tokens": 1, "temperature": 0.0}
        path = "/v1/completions"
        if self.name == MLX_VLM:  # chat only
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Hi."}]
            del body["prompt"]
        if self.request_model is not None:
            body["model"] = self.request_model
        httpx.post(self.url + path, json=body, timeout=300.0).raise_for_status()

    def start(self) -> Server:
        return self.launch().wait_ready()

    def blas(self) -> str | None:
        """The BLAS the server process loaded (None: cannot tell on this system)."""
        return "accelerate" if sys.platform == "darwin" else loaded_blas(self.pid)

    def rss_bytes(self) -> int | None:
        """Resident set size of the server process (Linux /proc; psutil elsewhere)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            import psutil  # type: ignore[import-not-found]

            return psutil.Process(self.pid).memory_info().rss
        except Exception:
            return None

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def restart(self) -> Server:
        self.stop()
        return self.start()
