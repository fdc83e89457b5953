"""MLX's backend, chosen at install time (mlx_prefix/backend.py) and named at startup
(platform.startup_line), tested without a GPU: a fake `nvidia-smi` on a PATH of the
test's own (only `sh` and `cat` besides, so a real `nvidia-smi`, as on a CUDA CI host,
never answers instead and every test runs there too), the environment variable, and the
device kind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_prefix import backend, launcher, platform
from mlx_prefix.backend import BACKEND_ENV, BackendChoice, choose, mlx_requirement, stale
from mlx_prefix.models.load import choose_dtype

REPO = Path(__file__).resolve().parents[1]
H100 = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.82.07              Driver Version: 580.82.07      CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:00:07.0 Off |                    0 |
"""


def fake_smi(folder: Path, cuda: str = "13.0", code: int = 0) -> Path:
    """A folder holding an `nvidia-smi` that prints a GPU table (exits `code`)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'T'\n{H100.format(cuda=cuda)}T\nexit {code}\n")
    script.chmod(0o755)
    return folder


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    """A folder holding only what the fake nvidia-smi runs (`sh`, `cat`), linked from the
    system: the rest of the PATH the tests give, where no real nvidia-smi can be."""
    folder = tmp_path / "tools"
    folder.mkdir()
    for name in ("sh", "cat"):
        found = shutil.which(name)
        assert found is not None, f"no {name} on this system"
        (folder / name).symlink_to(found)
    return folder


@pytest.fixture
def path_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tools: Path):
    """PATH as a folder (None: one with no nvidia-smi) and `tools`, nothing else."""
    bare = tmp_path / "bin"
    bare.mkdir()

    def use(folder: Path | None) -> None:
        monkeypatch.setenv("PATH", os.pathsep.join([str(folder or bare), str(tools)]))
        monkeypatch.delenv(BACKEND_ENV, raising=False)

    return use


def test_an_nvidia_gpu_gets_the_cuda_wheel_and_none_the_cpu_one(path_with, tmp_path: Path):
    path_with(fake_smi(tmp_path / "h100"))
    assert choose(platform="linux").extra == "cuda"
    path_with(fake_smi(tmp_path / "old-driver", cuda="12.4"))
    assert choose(platform="linux").extra == "cuda12"
    path_with(fake_smi(tmp_path / "ancient", cuda="11.8"))
    assert choose(platform="linux").extra == "cpu"
    path_with(fake_smi(tmp_path / "broken", code=9))  # no driver loaded: it fails
    assert choose(platform="linux").extra == "cpu"
    path_with(None)  # no nvidia-smi at all
    choice = choose(platform="linux")
    assert choice.extra == "cpu" and "no NVIDIA GPU" in choice.why


def test_the_environment_variable_forces_either(path_with, tmp_path: Path):
    path_with(fake_smi(tmp_path / "h100"))
    assert choose({BACKEND_ENV: "cpu"}, platform="linux") == BackendChoice(
        "cpu", f"{BACKEND_ENV}=cpu"
    )
    path_with(None)
    assert choose({BACKEND_ENV: "CUDA"}, platform="linux").extra == "cuda"
    assert choose({BACKEND_ENV: "cuda12"}, platform="linux").extra == "cuda12"
    unknown = choose({BACKEND_ENV: "rocm"}, platform="linux")
    assert unknown.extra == "cpu" and "rocm is not" in unknown.why  # said, then auto
    assert choose({BACKEND_ENV: "auto"}, platform="linux").extra == "cpu"


def test_macos_is_always_metal(path_with, tmp_path: Path):
    path_with(fake_smi(tmp_path / "h100"))
    assert choose({}, platform="darwin").extra == ""
    assert "ignored" in choose({BACKEND_ENV: "cuda"}, platform="darwin").why


def test_what_pip_installs_for_each_choice(monkeypatch: pytest.MonkeyPatch):
    assert mlx_requirement(BackendChoice("cpu", ""), "0.32.4") == "mlx[cpu]==0.32.4"
    assert mlx_requirement(BackendChoice("cuda", ""), "0.32.4") == "mlx[cuda13]==0.32.4"
    assert mlx_requirement(BackendChoice("", ""), "0.32.4") == "mlx==0.32.4"
    # pyproject: plain mlx, whatever the platform; its backend one extra of ours each.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert [d for d in project["dependencies"] if d.startswith("mlx")][:1] == ["mlx>=0.32.4"]
    for extra, mlx_extra in backend.MLX_EXTRAS.items():
        [requirement] = project["optional-dependencies"][extra]
        assert requirement.startswith(f"mlx[{mlx_extra}]>=")


def test_another_backend_installed_is_removed_first(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(backend, "installed", lambda: ["cpu"])
    assert stale(BackendChoice("cpu", "")) == []
    assert stale(BackendChoice("cuda", "")) == ["mlx", "mlx-cpu"]
    monkeypatch.setattr(backend, "installed", lambda: ["cpu", "cuda"])  # overwritten already
    assert stale(BackendChoice("cuda", "")) == ["mlx", "mlx-cpu", "mlx-cuda-13"]
    monkeypatch.setattr(backend, "installed", lambda: [])
    assert stale(BackendChoice("cuda", "")) == []


def _module(args: list[str], path: Path, tools: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}
    env["PATH"] = os.pathsep.join([str(path), str(tools)])
    command = [sys.executable, "-m", "mlx_prefix.backend", *args]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux backends")
def test_the_command_the_makefile_runs(tmp_path: Path, tools: Path):
    assert _module([], fake_smi(tmp_path / "gpu"), tools) == "cuda"
    why = _module(["--why"], fake_smi(tmp_path / "gpu"), tools)
    assert why.startswith("MLX backend: cuda (")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _module([], empty, tools) == "cpu"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_installs_the_chosen_extra(tmp_path: Path):
    # The fake comes first on PATH: a real nvidia-smi after it never answers.
    env = {k: v for k, v in os.environ.items() if k not in (BACKEND_ENV, "MAKEFLAGS")}
    env["PATH"] = os.pathsep.join([str(fake_smi(tmp_path / "gpu")), os.environ["PATH"]])

    def planned(**extra: str) -> str:
        command = ["make", "-n", "-B", "install", "VENV=" + str(tmp_path / "venv")]
        out = subprocess.run(
            command, capture_output=True, text=True, env={**env, **extra}, cwd=REPO, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert '-e ".[test,vision,cuda]"' in planned() and ".installed-cuda" in planned()
    cpu = planned(**{BACKEND_ENV: "cpu"})
    assert '-e ".[test,vision,cpu]"' in cpu and "libopenblas" in cpu  # the CPU's fast BLAS too


def test_dtypes_follow_the_device_as_on_metal():
    # float32 only on the CPU (half-precision matmuls are 50-100x slower there); a GPU,
    # Metal or CUDA, keeps the checkpoint's own dtype.
    assert choose_dtype(mx.cpu, "bfloat16") == "float32"
    assert choose_dtype(mx.gpu, "bfloat16") == "bfloat16"
    assert choose_dtype(mx.gpu, "float16") == "float16"
    assert choose_dtype(mx.gpu, "float32") == "float32"


def test_the_startup_line_names_the_backend(monkeypatch: pytest.MonkeyPatch):
    if mx.default_device() == mx.cpu:  # as on this CPU machine
        assert platform.backend_name() == "cpu"
        assert platform.startup_line().startswith("mlx-prefix: device=cpu backend=cpu blas=")

    class Cuda:
        @staticmethod
        def is_available() -> bool:
            return True

    # As on a CUDA machine: the default device is the GPU and MLX's CUDA backend answers.
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx, "cuda", Cuda)
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "NVIDIA H100 80GB HBM3"})
    monkeypatch.setattr(sys, "platform", "linux")
    assert platform.backend_name() == "cuda"
    assert platform.startup_line() == (
        "mlx-prefix: device=gpu backend=cuda (NVIDIA H100 80GB HBM3)"
    )
    monkeypatch.setattr(sys, "platform", "darwin")
    assert platform.backend_name() == "metal"


def test_the_launcher_names_the_extra_when_no_backend_is_installed(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(backend, "installed", lambda: ["cpu"])
    assert launcher.missing_backend() is None
    monkeypatch.setattr(backend, "installed", lambda: [])
    assert launcher.missing_backend() is None  # mlx.core imports here: a source build
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # as if it could not load
    problem = launcher.missing_backend()
    assert problem is not None and "mlx-prefix[cpu]" in problem and "[cuda]" in problem
