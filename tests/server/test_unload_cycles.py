"""Loading and unloading a model over and over keeps nothing per cycle (issue 52, item 4).

A subprocess loads SmolLM2, asks it, and unloads it, as the pool does (every load and
unload on the loader thread, the engine on a worker thread: mlx_threads.py), several
times. After each unload it reads how many OS threads the process has and how many bytes
glibc's heap has in use (`mallinfo2`: allocations, not pages, so no RSS noise). Before the
fix each cycle left three OS threads (MLX keeps an OS thread per Python thread that used
it; each with its stack and its malloc arena) and ~0.45 MiB of heap (the global random
key's chain of lazy splits that building the model drew; models/load.py). Both must stay
flat from the second cycle on. Linux with glibc only (reads /proc and glibc's counters);
the figure over 20 cycles of a server: benchmarks/studies/unload.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

from mlx_prefix.blas_exec import fast_blas_env

CYCLES = 6
MiB = 1 << 20

_RUN = """
import ctypes, gc, json, os, sys
sys.path.insert(0, sys.argv[1])
import test_unload_release as t
from mlx_prefix.models.default import ensure_default_model

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    ).split()]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
folder = ensure_default_model()
rows = []
for _ in range(int(sys.argv[2])):
    swapper, slot = t.loaded_engine(folder)
    t.ask(slot.served.engine, image=False)
    t.unload(swapper, slot)
    del swapper, slot
    gc.collect()
    rows.append({"threads": len(os.listdir("/proc/self/task")), "heap": mallinfo2().uordblks})
print(json.dumps(rows))
sys.stdout.flush()
os._exit(0)  # the figures are out: no interpreter teardown beside MLX's threads
"""


def _has_mallinfo2() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")  # glibc 2.33 and later
    except OSError:
        return False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _has_mallinfo2(),
    reason="reads /proc and glibc's mallinfo2",
)
def test_load_unload_cycles_keep_no_thread_and_no_heap():
    env = fast_blas_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", _RUN, str(Path(__file__).parent), str(CYCLES)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    threads = [r["threads"] for r in rows]
    heap = [r["heap"] for r in rows]
    # The first cycle starts what lives as long as the process (the loader, a worker).
    assert max(threads[1:]) <= threads[1], threads
    # Deterministic counts of allocated bytes; the bound is generous (before: ~2 MiB).
    assert heap[-1] - heap[1] < 1 * MiB, [round(h / MiB, 2) for h in heap]
