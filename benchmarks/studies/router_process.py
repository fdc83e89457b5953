"""SGLang's router (PyPI `sglang-router`, pinned below) as a subprocess in front of
mlx-prefix replicas: where to find it, how to start it, when it is ready.

`make test-deps` installs it into a venv of its own (.test-clients/sglang-router: its
FastAPI and aiohttp are no dependency of ours); a Python that imports `sglang_router`
already (pip install sglang-router==0.3.2 into this venv) is used first.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..server_process import free_port, stop_process

SGLANG_ROUTER = "0.3.2"
ROOT = Path(__file__).resolve().parents[2]
OWN_VENV = ROOT / ".test-clients" / "sglang-router"

# Health checks every 2 s and a worker out after 2 failures (defaults: 60 s, 3), so a
# lost replica leaves the rotation within seconds rather than a minute.
HEALTH = ("--health-check-interval-secs", "2", "--health-failure-threshold", "2")


def find_router() -> tuple[str | None, str]:
    """A Python that runs `sglang_router` (None and why not, where none does)."""
    if importlib.util.find_spec("sglang_router") is not None:
        return sys.executable, ""
    python = OWN_VENV / "bin" / "python"
    if python.exists():
        return str(python), ""
    return None, f"sglang-router {SGLANG_ROUTER} is not installed: run `make test-deps`"


@dataclass
class Router:
    """One router process over `workers` (base URLs). `start` blocks until every worker
    is registered and healthy."""

    workers: list[str]
    args: tuple[str, ...] = ()  # policy and its settings, --api-key
    log_path: Path | None = None
    port: int = 0
    proc: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> Router:
        python, why = find_router()
        if python is None:
            raise RuntimeError(why)
        self.port = free_port()
        cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *self.workers]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        cmd += ["--log-level", "warn", *HEALTH, *self.args]
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._log = out
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.wait_workers(len(self.workers), timeout_s)
        return self

    def workers_healthy(self) -> list[str]:
        """The worker URLs the router holds healthy now."""
        r = httpx.get(self.url + "/workers", headers=self._auth(), timeout=10)
        r.raise_for_status()
        return [w["url"] for w in r.json()["workers"] if w.get("is_healthy")]

    def wait_workers(self, count: int, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the router exited ({self.proc.returncode}); log: {self.log_path}"
                )
            try:
                if len(self.workers_healthy()) >= count:
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the router did not hold {count} healthy workers in {timeout_s:.0f}s")

    def _auth(self) -> dict[str, str]:
        if "--api-key" in self.args:
            return {"Authorization": f"Bearer {self.args[self.args.index('--api-key') + 1]}"}
        return {}

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()  # type: ignore[attr-defined]
        self._log = None
