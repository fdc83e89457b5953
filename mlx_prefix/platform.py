"""Where MLX runs and how fast: device, fast BLAS on Linux, dtype choice.

The `mlx[cpu]` wheel bundles a reference BLAS that makes float32 matmul ~65x slower
than OpenBLAS or MKL (measured: docs/install.md). A BLAS can only replace those
symbols if it is preloaded before the process starts, so `find_fast_blas()` is used
by the launcher, which re-executes the command with LD_PRELOAD set. macOS uses
Accelerate/Metal and is never touched.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BLAS_ENV = "MLX_PREFIX_BLAS"  # auto (default) | openblas | mkl | none | /path/to/lib.so
PRELOADED_ENV = "MLX_PREFIX_BLAS_PRELOADED"  # set by the launcher after re-exec
_CHOICES = ("auto", "openblas", "mkl", "none")


@dataclass(frozen=True, slots=True)
class BlasLibrary:
    name: str  # "openblas" | "mkl"
    path: str
    extra_env: tuple[tuple[str, str], ...] = ()


def _openblas_candidates() -> list[str]:
    found = []
    try:
        out = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if "libopenblas.so.0" in line and "=>" in line:
            found.append(line.split("=>", 1)[1].strip())
    found += glob.glob("/usr/lib/*/libopenblas.so.0")
    return [p for p in dict.fromkeys(found) if os.path.exists(p)]


def _mkl_candidates() -> list[str]:
    return sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so.*")))


def find_fast_blas(preference: str | None = None) -> BlasLibrary | None:
    """The BLAS to preload on Linux, or None (macOS, none installed, or disabled).

    `preference` (default: $MLX_PREFIX_BLAS): auto | openblas | mkl | none | a library
    path. A path that is not a file, or an unknown value, is reported on stderr and
    treated as auto.
    """
    if not sys.platform.startswith("linux"):
        return None
    raw = (preference or os.environ.get(BLAS_ENV) or "auto").strip()
    choice = raw.lower()
    if choice == "none":
        return None
    if "/" in raw or raw.startswith("~"):
        path = Path(raw).expanduser()
        if path.is_file():
            name = "mkl" if "mkl" in path.name else "openblas"
            return _with_env(BlasLibrary(name, str(path)))
        _warn(f"{BLAS_ENV}={raw}: not a file; looking for an installed BLAS instead")
        choice = "auto"
    elif choice not in _CHOICES:
        _warn(f"{BLAS_ENV}={raw} is not one of {' | '.join(_CHOICES)} | a path; using auto")
        choice = "auto"
    if choice in ("auto", "openblas") and (found := _openblas_candidates()):
        return BlasLibrary("openblas", found[0])
    if choice in ("auto", "mkl") and (found := _mkl_candidates()):
        return _with_env(BlasLibrary("mkl", found[0]))
    if choice != "auto":
        _warn(f"{BLAS_ENV}={raw}: no {choice} library found; MLX keeps its reference BLAS")
    return None


def _warn(message: str) -> None:
    # Runs in the launcher before logging is set up, and once only: the re-executed
    # process does not search again.
    print(f"mlx-prefix: warning: {message}", file=sys.stderr)


def _with_env(lib: BlasLibrary) -> BlasLibrary:
    if lib.name == "mkl":
        # MKL defaults to Intel's OpenMP, which clashes with the GNU one already loaded.
        return BlasLibrary(lib.name, lib.path, (("MKL_THREADING_LAYER", "GNU"),))
    return lib


def loaded_blas() -> str:
    """Which BLAS this process has mapped: 'openblas', 'mkl', 'accelerate' or 'reference'."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return blas_in_maps(maps)


def blas_in_maps(maps: str) -> str:
    """The fast BLAS named in a /proc/PID/maps listing, else 'reference'."""
    if "libopenblas" in maps:
        return "openblas"
    if "libmkl" in maps:
        return "mkl"
    return "reference"


def device_name() -> str:
    """The device kind (part of every cache key: keep these names stable)."""
    import mlx.core as mx

    device = mx.default_device()
    if device.type == mx.gpu:
        return "gpu (Metal)" if sys.platform == "darwin" else "gpu"
    return "cpu"


def backend_name() -> str:
    """The MLX backend this process computes on: 'metal', 'cuda' or 'cpu' (installed as
    mlx_prefix/backend.py chose)."""
    import mlx.core as mx

    if mx.default_device().type != mx.gpu:
        return "cpu"
    if sys.platform == "darwin":
        return "metal"
    return "cuda" if _cuda_available() else "gpu"


def startup_line() -> str:
    """One line for stderr at startup: device and backend, with the BLAS on the CPU or the
    GPU's name. Dtypes follow the device (models/load.py: float32 on the CPU only)."""
    backend = backend_name()
    line = f"mlx-prefix: device={device_name()} backend={backend}"
    if backend != "cpu":
        return line + _gpu_note()
    blas = loaded_blas()
    line += f" blas={blas}"
    if blas == "reference":
        line += (
            " (slow reference BLAS: install Debian's libopenblas0-pthread or `pip install mkl`"
            f", or set {BLAS_ENV})"
        )
    return line


def _cuda_available() -> bool:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)  # older MLX releases have no mx.cuda
    return cuda is not None and bool(cuda.is_available())


def _gpu_note() -> str:
    import mlx.core as mx

    try:
        name = mx.device_info().get("device_name")
    except Exception:  # an older MLX, a backend without it: the line goes without the name
        return ""
    return f" ({name})" if name else ""


def available_memory() -> int | None:
    """Bytes a model may still take: on Metal, MLX's recommended working set less what
    MLX holds; on CUDA the GPU's free memory; elsewhere the system's MemAvailable. None
    when unknown."""
    import mlx.core as mx

    if sys.platform == "darwin" and mx.metal.is_available():
        info = mx.device_info()
        limit = int(info.get("max_recommended_working_set_size", 0))
        return max(limit - mx.get_active_memory(), 0) if limit else None
    if mx.default_device().type == mx.gpu and _cuda_available():
        # The GPU's own memory (NVML: free across processes), not the host's.
        info = mx.device_info()
        if info.get("free_memory"):
            return int(info["free_memory"])
        if info.get("total_memory"):
            return max(int(info["total_memory"]) - mx.get_active_memory(), 0)
        return None
    return _proc_bytes("/proc/meminfo", "MemAvailable:")


def cap_buffer_cache(budget_bytes: int) -> int:
    """Cap MLX's cache of freed buffers at a quarter of the prompt cache's byte budget,
    never raising it; returns the limit now in force. The freed buffers MLX keeps for
    reuse are process memory outside the budget: Metal keeps up to its memory limit by
    default, the CPU allocator 32 MiB. Process-wide, so engines sharing a process keep
    the smallest of their caps."""
    import mlx.core as mx

    cap = budget_bytes // 4
    previous = mx.set_cache_limit(cap)
    if previous < cap:
        mx.set_cache_limit(previous)
        return previous
    return cap


def process_rss() -> int | None:
    """This process's resident set size in bytes, from Linux's /proc; None elsewhere or
    when unknown."""
    return _proc_bytes("/proc/self/status", "VmRSS:")


def _proc_bytes(path: str, field: str) -> int | None:
    """A `field: N kB` line of a /proc file, in bytes; None when there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))  # only glibc answers (musl: no)
    except (ValueError, OSError, AttributeError):
        return False


_TRIM: list = []  # [malloc_trim] once found; [None] when this libc has none


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim(0)`, every
    arena); returns whether it ran. glibc keeps what a thread freed in its arena, and
    most of a model's weights are below its mmap threshold once a big buffer has been
    freed, so without this an unloaded model stays resident (measured: each swap of
    SmolLM2 and back kept ~500 MiB). macOS, musl and other systems are left alone.
    Not for a hot path: it walks every arena (milliseconds on a large heap)."""
    if not _TRIM:
        fn = None
        if _glibc():
            import ctypes

            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _TRIM.append(fn)
    fn = _TRIM[0]
    if fn is None:
        return False
    fn(0)
    return True


def release_memory() -> None:
    """After an unload: MLX's cache of freed buffers emptied, then the heap trimmed."""
    import mlx.core as mx

    mx.clear_cache()
    trim_heap()
