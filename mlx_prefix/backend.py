"""Which MLX backend to install: Metal on macOS; on Linux CUDA where an NVIDIA GPU answers,
else the CPU. Standard library only: the Makefile runs it (`python -m mlx_prefix.backend`)
before anything is installed, and the launcher asks it which backend is installed.

On Linux, MLX ships its backend as a separate wheel chosen by an extra (mlx's own
metadata): `mlx[cpu]` -> mlx-cpu, `mlx[cuda13]` -> mlx-cuda-13 (CUDA 13 libraries from
PyPI), `mlx[cuda12]` -> mlx-cuda-12. Every one of them installs `mlx/lib/libmlx.so`, so two
in one environment overwrite each other, and uninstalling one deletes the other's library.
That is why mlx-prefix's own dependency is plain `mlx` and the backend is an extra of
ours (`mlx-prefix[cpu]`, `[cuda]`, `[cuda12]`), chosen here: a fixed `mlx[cpu]` dependency
would install the CPU wheel beside (and over) the CUDA one on a GPU machine.

`MLX_PREFIX_BACKEND` forces the choice: auto (default) | cpu | cuda | cuda12.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata

BACKEND_ENV = "MLX_PREFIX_BACKEND"
_FORCED = ("cpu", "cuda", "cuda12")
# Our extra -> MLX's extra and the wheel it installs (pyproject.toml's optional dependencies).
MLX_EXTRAS = {"cpu": "cpu", "cuda": "cuda13", "cuda12": "cuda12"}
WHEELS = {"cpu": "mlx-cpu", "cuda": "mlx-cuda-13", "cuda12": "mlx-cuda-12"}
_DRIVER_CUDA = re.compile(r"CUDA Version:\s*(\d+)\.(\d+)")


@dataclass(frozen=True, slots=True)
class BackendChoice:
    extra: str  # mlx-prefix's extra to install: cpu | cuda | cuda12; "" on macOS (Metal)
    why: str  # one line for the person installing


def nvidia_smi(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str | None:
    """What `nvidia-smi` prints (its table names the driver's CUDA version), or None where
    it is missing, fails, or lists no GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = run([exe], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or "NVIDIA-SMI" not in out.stdout:
        return None
    return out.stdout


def choose(
    env: Mapping[str, str] | None = None,
    platform: str = sys.platform,
    smi: Callable[[], str | None] = nvidia_smi,
) -> BackendChoice:
    """The backend to install here. Does not install anything."""
    env = os.environ if env is None else env
    forced = (env.get(BACKEND_ENV) or "auto").strip().lower()
    if platform == "darwin":
        if forced not in ("auto", "metal"):
            return BackendChoice("", f"{BACKEND_ENV}={forced} ignored: macOS runs MLX on Metal")
        return BackendChoice("", "macOS: MLX on Metal")
    if forced in _FORCED:
        return BackendChoice(forced, f"{BACKEND_ENV}={forced}")
    prefix = "" if forced == "auto" else f"{BACKEND_ENV}={forced} is not auto | cpu | cuda: "
    table = smi()
    if table is None:
        return BackendChoice("cpu", prefix + "no NVIDIA GPU answers nvidia-smi: MLX on the CPU")
    version = _DRIVER_CUDA.search(table)
    if version is not None and int(version.group(1)) == 12:
        return BackendChoice("cuda12", prefix + "nvidia-smi: a CUDA 12 driver: MLX's CUDA 12 wheel")
    if version is not None and int(version.group(1)) < 12:
        why = f"nvidia-smi: CUDA {version.group(1)}.{version.group(2)} is older than MLX needs"
        return BackendChoice("cpu", prefix + why + ": MLX on the CPU")
    return BackendChoice("cuda", prefix + "nvidia-smi answers: MLX's CUDA 13 wheel")


def mlx_requirement(choice: BackendChoice, version: str) -> str:
    """The pip requirement for MLX `version` with the chosen backend (`mlx[cpu]==V`,
    `mlx[cuda13]==V`, plain `mlx==V` on macOS): for environments of their own (peers)."""
    extra = MLX_EXTRAS.get(choice.extra)
    return f"mlx[{extra}]=={version}" if extra else f"mlx=={version}"


def installed() -> list[str]:
    """Our extras whose MLX backend wheel is installed in this environment."""
    found = []
    for extra, wheel in WHEELS.items():
        try:
            metadata.version(wheel)
        except metadata.PackageNotFoundError:
            continue
        found.append(extra)
    return found


def stale(choice: BackendChoice) -> list[str]:
    """Distributions to uninstall before installing `choice`: every backend wheel, and
    mlx itself, when a backend other than the chosen one is installed (they share
    files: see the module docstring); nothing otherwise."""
    present = installed()
    if not present or present == [choice.extra]:
        return []
    return ["mlx", *(WHEELS[extra] for extra in present)]


def main(argv: list[str] | None = None) -> int:
    """`python -m mlx_prefix.backend`: print our extra to install (empty on macOS).
    `--why`: the choice and its reason. `--stale`: what to uninstall first (space-separated)."""
    args = sys.argv[1:] if argv is None else argv
    choice = choose()
    if args == ["--stale"]:
        print(" ".join(stale(choice)))
    elif args == ["--why"]:
        print(f"MLX backend: {choice.extra or 'metal'} ({choice.why})")
    elif not args:
        print(choice.extra)
    else:
        print("usage: python -m mlx_prefix.backend [--why | --stale]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
