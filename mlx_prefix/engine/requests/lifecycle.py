"""A job's life from the caller's queue to its one final event.

Callers put jobs into the inbox (any thread); the engine thread takes them, and ends
each exactly once (`end`): a DoneEvent or an ErrorEvent, after which nothing more is
sent. `pending` counts the requests submitted and not yet ended, which bounds the
queue (`max_queued`, a 429 past it) and tells tests the engine is drained.
"""

from __future__ import annotations

import queue
import threading

from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.errors import EngineBusy, MlxPrefixError
from mlx_prefix.records import DoneEvent, ErrorEvent

_WAKE = object()  # wakes the engine without a job (engine/sharded/distributed.py's cache actions)


class Lifecycle:
    def __init__(self, max_queued: int):
        # Requests that may decode at once (not waiting): the engine thread sets it once
        # its calibration knows (engine/loop.py); until then one.
        self.capacity = 1
        self._max_queued = max_queued
        self._inbox: queue.SimpleQueue[Job | object | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not ended; guarded by _lock
        self._accepting = True

    @property
    def pending(self) -> int:
        return self._pending

    # -- any thread ----------------------------------------------------------------
    def put(self, job: Job) -> None:
        """Queue a request. Raises EngineBusy when shutting down or too many wait."""
        with self._lock:
            if not self._accepting:
                raise EngineBusy("the server is shutting down")
            waiting = self._pending - self.capacity
            if waiting >= self._max_queued:
                raise EngineBusy(f"too many requests waiting ({waiting}); try again shortly")
            self._pending += 1
            # Under the lock: once `close` stops accepting, no job can land behind the
            # engine's last look at its inbox.
            self._inbox.put(job)

    def put_background(self, job: Job) -> None:
        """Queue a background job: not counted against `max_queued` (it never keeps a
        request out); dropped silently once shutting down."""
        with self._lock:
            if self._accepting:
                self._inbox.put(job)

    def wake(self) -> None:
        """Make a waiting `take` return (with no job)."""
        self._inbox.put(_WAKE)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def close(self) -> None:
        """Stop accepting and wake the engine with the shutdown marker."""
        self.stop_accepting()
        self._inbox.put(None)

    # -- engine thread -------------------------------------------------------------
    def take(self, block: bool, timeout: float | None = None) -> tuple[list[Job], bool]:
        """Jobs submitted since the last call (waiting up to `timeout` for one when
        `block`), and whether the shutdown marker was among them."""
        jobs: list[Job] = []
        closing = False
        try:
            job = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            while True:
                if job is None:
                    closing = True
                elif job is not _WAKE:
                    jobs.append(job)  # type: ignore[arg-type]
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return jobs, closing

    def end(self, job: Job, event: DoneEvent | ErrorEvent) -> None:
        """Send a job's last event (once: later calls are ignored, from any thread: a
        sharded engine's watch may end jobs while the engine thread fails them too)."""
        with self._lock:
            if job.ended:
                return
            job.ended = True
        job.handle.emit(event)
        if job.warm is not None and not job.warm.done():
            job.warm.set_exception(
                EngineBusy("the warm-up was cancelled")
                if isinstance(event, DoneEvent)
                else MlxPrefixError(event.message)
            )
        self.finished(job)

    def finished(self, job: Job) -> None:
        """Count a job as done without an event (warm-ups and prefetches that
        completed: their result went elsewhere)."""
        job.ended = True
        if job.background:
            return  # never counted in pending
        with self._lock:
            self._pending -= 1


def error_message(error: BaseException) -> str:
    if isinstance(error, MlxPrefixError):
        return error.message
    return f"{type(error).__name__}: {error}"
