"""vllm-mlx, the second peer (issue 33): version 0.6.0 from PyPI in its own git-ignored
venv, `.peers/vllm-mlx/`, with MLX pinned to the version mlx-prefix runs on, so both
peers and mlx-prefix compute on the same MLX. `make peers` (which `make bench` runs) or
`python -m benchmarks.peers` installs it; a run where it is missing says why and goes on
without it. The install needs a package registry, so the benchmark never runs it itself.

    vllm-mlx serve MODEL --port P --continuous-batching

A request to it names the model by the path it was started with.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlx_prefix.backend import choose, mlx_requirement

VLLM_MLX_VERSION = "0.6.0"
MLX_VERSION = "0.32.4"
VENV = Path(__file__).resolve().parent.parent / ".peers" / "vllm-mlx"
STAMP = VENV / ".installed"  # the requirements it was installed with, one a line


def requirements() -> list[str]:
    # MLX with the backend mlx-prefix installs here (Linux: CPU, or CUDA with a GPU).
    return [f"vllm-mlx=={VLLM_MLX_VERSION}", mlx_requirement(choose(), MLX_VERSION)]


def vllm_mlx_command(venv: Path = VENV) -> Path:
    return venv / "bin" / "vllm-mlx"


def vllm_mlx_problem(venv: Path = VENV) -> str | None:
    """Why vllm-mlx cannot run here (None: it is installed as pinned)."""
    stamp = venv / STAMP.name
    if not vllm_mlx_command(venv).is_file() or not stamp.is_file():
        return f"vllm-mlx {VLLM_MLX_VERSION} is not installed in {venv} (`make peers` installs it)"
    if stamp.read_text().split() != requirements():
        return f"{venv} holds other versions than {' '.join(requirements())} (`make peers`)"
    return None


def installed_versions(venv: Path = VENV) -> dict[str, str]:
    """vllm-mlx's version and the mlx / mlx-lm it runs on (its pins may differ from the
    other servers'), read from the venv's package metadata; {} where not installed."""
    out = {}
    for dist in ("vllm_mlx", "mlx", "mlx_lm"):
        found = sorted(venv.glob(f"lib/python*/site-packages/{dist}-*.dist-info"))
        if found:
            version = found[-1].name[len(dist) + 1 : -len(".dist-info")]
            out["vllm-mlx" if dist == "vllm_mlx" else f"{dist.replace('_', '-')} (vllm-mlx)"] = (
                version
            )
    return out


def mlx_vlm_problem(venv: Path = VENV) -> str | None:
    """Why mlx-vlm's own server cannot run here (None: it can). The shared venv holds
    mlx-vlm without its dependencies (its server needs fastapi, cryptography and
    mlx-audio); vllm-mlx's venv holds mlx-vlm 0.7.10 with all of them, so the server
    runs from there."""
    if vllm_mlx_problem(venv) is not None:
        return f"mlx-vlm's server runs from vllm-mlx's venv: {vllm_mlx_problem(venv)}"
    for dist in ("mlx_vlm-0.7.10", "fastapi-", "cryptography-", "mlx_audio-"):
        if not list(venv.glob(f"lib/python*/site-packages/{dist}*.dist-info")):
            return f"{venv} lacks {dist.rstrip('-')} for mlx-vlm's server"
    return None


def mlx_vlm_version(venv: Path = VENV) -> dict[str, str]:
    """mlx-vlm's version in vllm-mlx's venv, where its server runs ({} where absent)."""
    found = sorted(venv.glob("lib/python*/site-packages/mlx_vlm-*.dist-info"))
    return {"mlx-vlm": found[-1].name[len("mlx_vlm-") : -len(".dist-info")]} if found else {}


def install(venv: Path = VENV) -> str | None:
    """Create the venv and install the pinned requirements (idempotent). Returns why it
    failed, or None."""
    if vllm_mlx_problem(venv) is None:
        return None
    try:
        if not (venv / "bin" / "python").is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, *requirements()], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"could not install vllm-mlx into {venv}: {e}"
    (venv / STAMP.name).write_text("\n".join(requirements()) + "\n")
    return None


def main() -> int:
    problem = install()
    if problem is not None:
        print(f"warning: {problem}; the benchmarks run without vllm-mlx", file=sys.stderr)
    else:
        print(f"vllm-mlx {VLLM_MLX_VERSION}: {vllm_mlx_command()}")
    return 0  # a missing peer is not a failed build: the benchmark says so and goes on


if __name__ == "__main__":
    sys.exit(main())
