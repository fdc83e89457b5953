"""Which BLAS gets preloaded, and the launcher's re-exec that preloads it.

pytest may run under `mlx_prefix.blas_exec` or not (`make test` does), so what a process
maps is tested in subprocesses started without the preload variables.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_prefix import launcher, platform
from mlx_prefix.blas_exec import fast_blas_env
from mlx_prefix.platform import BLAS_ENV, PRELOADED_ENV, BlasLibrary, find_fast_blas

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS preload")


@pytest.fixture
def libs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Pretend these libraries are installed; the test edits the lists."""
    installed = {"openblas": [str(tmp_path / "libopenblas.so.0")], "mkl": []}
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv(BLAS_ENV, raising=False)
    monkeypatch.setattr(platform, "_openblas_candidates", lambda: list(installed["openblas"]))
    monkeypatch.setattr(platform, "_mkl_candidates", lambda: list(installed["mkl"]))
    return installed


def test_auto_prefers_openblas_then_mkl(libs: dict[str, list[str]]) -> None:
    libs["mkl"] = ["/opt/libmkl_rt.so.2"]
    assert find_fast_blas() == BlasLibrary("openblas", libs["openblas"][0])
    libs["openblas"] = []
    assert find_fast_blas("auto") == BlasLibrary(
        "mkl", "/opt/libmkl_rt.so.2", (("MKL_THREADING_LAYER", "GNU"),)
    )
    libs["mkl"] = []
    assert find_fast_blas() is None


def test_named_choice_and_none(
    libs: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    libs["mkl"] = ["/opt/libmkl_rt.so.2"]
    assert find_fast_blas("mkl").name == "mkl"
    assert find_fast_blas("OpenBLAS").name == "openblas"
    assert find_fast_blas("none") is None
    monkeypatch.setenv(BLAS_ENV, "none")
    assert find_fast_blas() is None
    assert capsys.readouterr().err == ""


def test_requested_library_not_installed_warns(
    libs: dict[str, list[str]], capsys: pytest.CaptureFixture
) -> None:
    assert find_fast_blas("mkl") is None
    assert "no mkl library found" in capsys.readouterr().err


def test_path_is_preloaded_as_given(
    libs: dict[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    mkl = tmp_path / "libmkl_rt.so.2"
    custom = tmp_path / "libblas-custom.so"
    mkl.touch()
    custom.touch()
    assert find_fast_blas(str(mkl)) == BlasLibrary(
        "mkl", str(mkl), (("MKL_THREADING_LAYER", "GNU"),)
    )
    assert find_fast_blas(str(custom)) == BlasLibrary("openblas", str(custom))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value", ["/nonexistent/libopenblas.so.0", "./missing.so", "/tmp"])
def test_missing_path_warns_and_falls_back_to_auto(
    libs: dict[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    value: str,
) -> None:
    monkeypatch.setenv(BLAS_ENV, value)
    assert find_fast_blas() == BlasLibrary("openblas", libs["openblas"][0])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and value in err


def test_unknown_value_warns_and_falls_back_to_auto(
    libs: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(BLAS_ENV, "bogus")
    assert find_fast_blas() == BlasLibrary("openblas", libs["openblas"][0])
    err = capsys.readouterr().err
    assert "warning" in err and "bogus" in err and "auto" in err


def test_never_preloads_outside_linux(
    libs: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert find_fast_blas("openblas") is None


def test_blas_in_maps() -> None:
    assert platform.blas_in_maps("7f00 r-xp /usr/lib/x86_64-linux-gnu/libopenblasp-r0.3.so") == (
        "openblas"
    )
    assert platform.blas_in_maps("7f00 r-xp /venv/lib/libmkl_core.so.2") == "mkl"
    assert platform.blas_in_maps("7f00 r-xp /venv/mlx_cpu.libs/libblas-bd8a282c.so.3") == (
        "reference"
    )


@linux_only
@pytest.mark.parametrize("blas", [None, "none"])
def test_loaded_blas_is_the_one_blas_exec_preloaded(blas: str | None) -> None:
    # In a child started through blas_exec (this process may or may not have been).
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", PRELOADED_ENV)}
    env.pop(BLAS_ENV, None)
    if blas is not None:
        env[BLAS_ENV] = blas
    code = "import mlx.core; from mlx_prefix import platform; print(platform.loaded_blas())"
    child = [sys.executable, "-m", "mlx_prefix.blas_exec", sys.executable, "-c", code]
    out = subprocess.run(child, capture_output=True, text=True, timeout=120, env=env, check=True)
    found = find_fast_blas("auto") if blas is None else None
    assert out.stdout.strip() == (found.name if found is not None else "reference")


def test_fast_blas_env_prepends_the_library(libs: dict[str, list[str]]) -> None:
    env = fast_blas_env({"LD_PRELOAD": "/opt/other.so", "HOME": "/home/x"})
    assert env["LD_PRELOAD"] == f"{libs['openblas'][0]}:/opt/other.so"
    assert env[PRELOADED_ENV] == "openblas" and env["HOME"] == "/home/x"
    libs["openblas"] = []
    assert fast_blas_env({"HOME": "/home/x"}) == {"HOME": "/home/x"}


def test_launcher_reexecs_once_with_the_library(
    libs: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv(PRELOADED_ENV, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    launcher.reexec_with_fast_blas(["cache", "ls"])
    [(exe, argv, env)] = calls
    assert exe == sys.executable
    assert argv == [sys.executable, "-m", "mlx_prefix", "cache", "ls"]
    assert env["LD_PRELOAD"] == libs["openblas"][0] and env[PRELOADED_ENV] == "openblas"

    monkeypatch.setenv(PRELOADED_ENV, "openblas")  # the re-executed process
    launcher.reexec_with_fast_blas(["cache", "ls"])
    monkeypatch.delenv(PRELOADED_ENV)
    monkeypatch.setenv(BLAS_ENV, "none")
    launcher.reexec_with_fast_blas(["cache", "ls"])
    assert len(calls) == 1


def _run_cli(tmp_path: Path, blas: str | None) -> subprocess.CompletedProcess:
    """`mlx-prefix cache ls` as a user starts it: no preload inherited from pytest."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", PRELOADED_ENV)}
    env.pop(BLAS_ENV, None)
    if blas is not None:
        env[BLAS_ENV] = blas
    script = Path(sys.executable).with_name("mlx-prefix")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mlx_prefix"]
    return subprocess.run(
        [*command, "cache", "ls", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _startup_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mlx-prefix: device=")]


@linux_only
def test_console_script_preloads_openblas(tmp_path: Path) -> None:
    if not platform._openblas_candidates():
        pytest.skip("no OpenBLAS installed")
    result = _run_cli(tmp_path, None)
    assert result.returncode == 0, result.stderr
    [line] = _startup_lines(result.stderr)
    assert "blas=openblas" in line


@linux_only
def test_console_script_with_blas_none_keeps_the_reference_blas(tmp_path: Path) -> None:
    result = _run_cli(tmp_path, "none")
    assert result.returncode == 0, result.stderr
    [line] = _startup_lines(result.stderr)
    assert "blas=reference" in line


@linux_only
def test_console_script_with_a_missing_path_warns_once_and_uses_auto(tmp_path: Path) -> None:
    result = _run_cli(tmp_path, "/nonexistent/libopenblas.so.0")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("warning: MLX_PREFIX_BLAS=/nonexistent") == 1
    assert "cannot be preloaded" not in result.stderr  # the dynamic loader's complaint
    [line] = _startup_lines(result.stderr)
    expected = "openblas" if platform._openblas_candidates() else "reference"
    assert f"blas={expected}" in line


def test_package_import_is_light_and_exports_the_session() -> None:
    # The launcher imports mlx_prefix before the re-exec: loading MLX there would map
    # its reference BLAS before the fast one could be preloaded.
    code = (
        "import sys, mlx_prefix, mlx_prefix.launcher\n"
        "assert 'mlx' not in sys.modules, 'mlx imported'\n"
        "from mlx_prefix import PrefixCacheSession\n"
        "from mlx_prefix.session import PrefixCacheSession as direct\n"
        "assert PrefixCacheSession is direct and 'PrefixCacheSession' in dir(mlx_prefix)\n"
        "try:\n"
        "    mlx_prefix.nope\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('mlx_prefix.nope did not raise AttributeError')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
