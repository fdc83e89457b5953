"""What a run records about where it ran: the machine (CPU, cores, RAM, the preloaded
BLAS) and the versions of mlx, mlx-lm, mlx-prefix and the peers."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import peers


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    ram = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        import subprocess

        try:
            cpu = (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
                ).stdout.strip()
                or cpu
            )
            ram = int(
                subprocess.run(
                    ["sysctl", "-n", "hw.memsize"], capture_output=True, text=True
                ).stdout.strip()
            )
        except (OSError, ValueError):
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(ram / 2**30, 1) if ram else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "blas": _preloaded_blas(),
    }


def _preloaded_blas() -> str | None:
    from mlx_prefix.platform import PRELOADED_ENV

    return os.environ.get(PRELOADED_ENV)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("mlx", "mlx-lm", "mlx-prefix"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "?"
    return out | peers.installed_versions()
