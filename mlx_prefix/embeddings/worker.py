"""EmbeddingWorker: the one thread that runs the embedding model.

The server's rule is one thread per model for all MLX work (MLX streams are thread-local,
and a model's arrays are only ever computed on by its own thread): the chat engine has its
engine thread, the embedding model this worker. HTTP handlers never touch arrays: they
tokenize, submit token ids and await a future. Each turn the worker takes every request
waiting, plans their sequences into padded forwards together (batches.py), and hands each
request its rows. A request whose client left before its turn is skipped.

The two threads share the machine: an embedding batch and a chat step may run at once
(as two engines of the model pool may).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from mlx_prefix.errors import EngineBusy, MlxPrefixError, Unavailable

from .batches import MAX_BATCH_ROWS, MAX_BATCH_TOKENS, plan_batches
from .model import EmbeddingModel

log = logging.getLogger("mlx_prefix.embeddings")

MAX_QUEUED = 64  # requests waiting; past that a 429


@dataclass(slots=True)
class _Job:
    rows: list[list[int]]  # token ids, each non-empty
    future: Future[np.ndarray]  # -> float32 [len(rows), dimensions]


@dataclass
class WorkerStats:
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0  # spent computing
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: getattr(self, k) for k in ("requests", "inputs", "tokens", "forwards",
                                                   "seconds")}  # fmt: skip


class EmbeddingWorker:
    def __init__(
        self,
        model: EmbeddingModel,
        *,
        max_queued: int = MAX_QUEUED,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        max_batch_rows: int = MAX_BATCH_ROWS,
    ):
        self.model = model
        self.max_queued = max_queued
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows
        self.stats = WorkerStats()
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mlx-prefix-embed", daemon=True)
        self._thread.start()

    def submit(self, rows: list[list[int]]) -> Future[np.ndarray]:
        """Queue `rows` (token id lists, each non-empty); the future gets their vectors,
        float32 [len(rows), dimensions], pooled and normalised as the model does. Thread-
        safe. EngineBusy past `max_queued` waiting requests; Unavailable once closed."""
        assert rows and all(rows)
        future: Future[np.ndarray] = Future()
        with self._lock:
            if self._closed:
                raise Unavailable("the embedding model is shutting down")
            if self._queued >= self.max_queued:
                raise EngineBusy(
                    f"{self._queued} embedding requests are waiting; try again shortly"
                )
            self._queued += 1
        self._inbox.put(_Job(rows, future))
        return future

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the requests already queued (the server's shutdown)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- the worker thread ----------------------------------------------------------
    def _run(self) -> None:
        import mlx.core as mx

        try:
            stop = False
            while not stop:
                jobs, stop = self._take()
                with self._lock:
                    self._queued -= len(jobs)
                live = [j for j in jobs if j.future.set_running_or_notify_cancel()]
                if live:
                    self._serve(live)
        finally:
            # MLX requires each thread to destroy its own streams before it exits.
            mx.clear_streams()

    def _take(self) -> tuple[list[_Job], bool]:
        """Block for one job, then take whatever else is waiting."""
        first = self._inbox.get()
        if first is None:
            return [], True
        jobs = [first]
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return jobs, False
            if job is None:
                return jobs, True
            jobs.append(job)

    def _serve(self, jobs: list[_Job]) -> None:
        rows = [row for job in jobs for row in job.rows]
        started = time.perf_counter()
        try:
            vectors = self._embed(rows)
        except Exception as e:  # noqa: BLE001 - each waiting request gets the failure
            log.exception("embedding %d inputs failed", len(rows))
            err = MlxPrefixError(f"embedding failed: {type(e).__name__}: {e}")
            for job in jobs:
                job.future.set_exception(err)
            return
        elapsed = time.perf_counter() - started
        with self.stats._lock:
            self.stats.requests += len(jobs)
            self.stats.inputs += len(rows)
            self.stats.tokens += sum(map(len, rows))
            self.stats.seconds += elapsed
        start = 0
        for job in jobs:
            job.future.set_result(vectors[start : start + len(job.rows)])
            start += len(job.rows)

    def _embed(self, rows: list[list[int]]) -> np.ndarray:
        out = np.empty((len(rows), self.model.dimensions), dtype=np.float32)
        plan = plan_batches([len(r) for r in rows], self.max_batch_tokens, self.max_batch_rows)
        for batch in plan:
            out[batch] = self.model.embed([rows[i] for i in batch])
            with self.stats._lock:
                self.stats.forwards += 1
        return out
