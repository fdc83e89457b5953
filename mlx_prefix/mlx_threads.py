"""Long-lived threads for MLX work: the loader (`on_loader_thread`: every model load and
unload, one at a time) and reusable threads for engines (`start`: an engine's loop).

Why never a fresh thread per model: MLX (0.32) gives each Python thread its own streams,
and each stream runs its work on an OS thread of its own that outlives the Python thread
(`mx.clear_streams` included: measured, every Python thread that evaluated anything
left one OS thread behind). A server that loaded, served and unloaded each model on new
threads kept three OS threads a cycle, each with its stack and its glibc malloc arena
(a thread's arena is reused only once the thread exits; up to 8 per core are made), so
its RSS grew ~1.5 MiB a cycle (benchmarks/studies/unload.py: 27 MiB over 20 cycles of
SmolLM2). Here the loader's thread lives as long as the process and an engine's thread
goes back to a pool when the engine stops: the OS threads and arenas stay as many as
the most engines ever run at once, and each load reuses what the last unload gave back.

A thread never destroys its MLX streams between jobs (a stream still referenced by an
array of the next job's would be gone: "There is no Stream(cpu, 0) in current thread");
it does when it stops, at the interpreter's exit (MLX requires a thread to destroy its
own streams before it exits, or the process may abort at exit).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mlx_prefix.threads")


@dataclass(eq=False)
class Run:
    """One job on a worker: its outcome, and a thread's `join` / `is_alive` for it."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    name: str
    report: bool  # log an exception the job raised (nobody awaits its future)
    future: Future[Any] = field(default_factory=Future)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the job to end."""
        try:
            self.future.exception(timeout)
        except Exception:  # noqa: BLE001 - a timeout, or cancelled: the caller asks is_alive
            pass

    def is_alive(self) -> bool:
        return not self.future.done()


class Worker:
    """A daemon thread that runs the jobs handed to it, one at a time, until closed."""

    def __init__(self, name: str, idle: list[Worker] | None = None):
        self._jobs: queue.SimpleQueue[Run | None] = queue.SimpleQueue()
        self._idle = idle  # the pool it goes back to after each job (None: dedicated)
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, run: Run) -> Run:
        self._jobs.put(run)
        return run

    def close(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        import mlx.core as mx

        own = self.thread.name
        try:
            while (run := self._jobs.get()) is not None:
                self.thread.name = run.name
                error: BaseException | None = None
                try:
                    result = run.fn(*run.args)
                except BaseException as e:  # noqa: BLE001 - handed over (or logged)
                    if run.report:
                        log.exception("%s stopped on an error", run.name)
                    error, result = e, None
                self.thread.name = own
                # Nothing of the job may outlive its end as seen by the waiter: an
                # engine's unload joins its loop, then collects and trims the heap.
                run.fn, run.args = _spent, ()
                if self._idle is not None:  # idle before the job's end is seen: the
                    with _GUARD:  # engine that replaces this one gets this thread
                        self._idle.append(self)
                _settle(run.future, result=result, exception=error)
                del run, result, error  # nothing of the last job outlives it here
        finally:
            mx.clear_streams()


def _spent() -> None:
    """What a finished Run calls (none): it no longer holds its job's function."""


def _settle(future: Future[Any], result: Any = None, exception: BaseException | None = None):
    """Hand the outcome over, unless the awaiting side gave up meanwhile (the server
    shutting down cancels the asyncio future, and with it this one): the work is done
    either way, and a cancelled future refuses a result."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


_GUARD = threading.Lock()
_IDLE: list[Worker] = []  # engine threads between engines
_ALL: list[Worker] = []
_LOADER: list[Worker] = []  # the process's loader, made on first use


def on_loader_thread(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run `fn(*args)` on the process's loader thread, after the jobs handed to it
    before; its outcome in the future."""
    with _GUARD:
        if not _LOADER:
            _LOADER.append(_new_worker("mlx-prefix-load", idle=None))
        loader = _LOADER[0]
    return loader.submit(Run(fn, args, "mlx-prefix-load", report=False)).future


def start(fn: Callable[..., Any], *args: Any, name: str) -> Run:
    """Run `fn(*args)` (a loop that runs until told to stop: an engine's) on a thread
    an earlier run left idle, or on a new one; an exception it raises is logged."""
    with _GUARD:
        worker = _IDLE.pop() if _IDLE else _new_worker("mlx-prefix-worker", idle=_IDLE)
    return worker.submit(Run(fn, args, name, report=True))


def _new_worker(name: str, idle: list[Worker] | None) -> Worker:
    """Under _GUARD."""
    if not _ALL:
        atexit.register(_stop_idle)
    worker = Worker(name, idle)
    _ALL.append(worker)
    return worker


def _stop_idle(timeout: float = 2.0) -> None:
    """At the interpreter's exit: the threads with no job stop (their streams
    destroyed); one still running a job (an engine never shut down) is left as it is."""
    with _GUARD:
        stopping = [*_IDLE, *_LOADER]
        _IDLE.clear()
    for worker in stopping:
        worker.close()
    for worker in stopping:
        worker.thread.join(timeout / max(len(stopping), 1))
