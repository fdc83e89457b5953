"""Run a call with a time bound, for chat template rendering (prompt/request/render.py).

A Jinja template is a program: `{% for i in range(99999) %}{% for j in range(99999) %}`
runs for hours, and rendering happens in a handler's thread shielded from client
disconnects (or on the engine thread, for a prefetch). jinja2's sandbox (which
transformers renders in) stops attribute tricks, not loops. So the call runs on a
thread of its own while the caller waits at most `timeout_s`; past it, the caller gets
`Timeout` and the thread is interrupted with an asynchronous exception (Python checks
for one between bytecodes, so a template loop ends at its next step). A call stuck
inside one C function cannot be interrupted that way: it is left to finish on its
daemon thread, and the caller has its answer all the same.

The thread is made for the one call, so an interruption that arrives as the call ends
lands in that thread's own wrapper, never in a caller or in a later call.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("mlx_prefix.prompt")
T = TypeVar("T")
_JOIN_AFTER_INTERRUPT_S = 1.0


class Timeout(Exception):
    """The call took longer than its bound."""


class _Interrupted(BaseException):
    """Raised inside the call's thread to end it (BaseException: `except Exception` in the
    rendering code must not swallow it)."""


def call_bounded(fn: Callable[[], T], timeout_s: float, name: str = "bounded") -> T:
    """`fn()`, or Timeout once it has run `timeout_s` seconds. `fn` runs on another
    thread: it must not rely on thread-local state (MLX streams)."""
    outcome: list[T] = []
    failure: list[BaseException] = []
    lock = threading.Lock()
    done = False

    def run() -> None:
        nonlocal done
        try:
            try:
                outcome.append(fn())
            except _Interrupted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                failure.append(e)
            finally:
                with lock:  # from here on the caller interrupts no more
                    done = True
            # One may have been sent just before: drop it while still inside this try,
            # so it can never surface after this function (in threading's own code).
            _set_async_exc(threading.get_ident(), None)
        except _Interrupted:
            pass

    thread = threading.Thread(target=run, name=f"mlx-prefix-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        overdue = not done
        if overdue:
            _set_async_exc(thread.ident, _Interrupted)
    if overdue:
        thread.join(_JOIN_AFTER_INTERRUPT_S)
        if thread.is_alive():
            log.warning("%s: still running %.0fs past its bound; left to finish", name, timeout_s)
        raise Timeout(f"took longer than {timeout_s:g}s")
    thread.join()  # done: it only has its last lines to run
    if failure:
        raise failure[0]
    return outcome[0]


def _set_async_exc(ident: int | None, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `ident` at its next check; None clears a pending one."""
    if ident is not None:
        _SET_ASYNC_EXC(ident, None if exc is None else id(exc))  # 0: the thread has ended


# Its own prototype (a copy), so no other user of ctypes.pythonapi changes our argtypes.
_SET_ASYNC_EXC = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)
