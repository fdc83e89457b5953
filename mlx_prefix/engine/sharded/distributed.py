"""DistributedEngine: the engine of a model sharded over the ranks of an `mlx.launch`
group. Every rank runs the same engine steps on its own shard; rank 0 decides.

A forward of a sharded model is a collective: every rank must run the same forwards,
with the same shapes, in the same order. So every rank runs this engine, with the same
code for matching, restoring, prefill chunks, checkpoints, eviction and decoding, and
every input that is not already the same on every rank comes from rank 0: once per
turn, before any forward, rank 0 sends the turn's plan and every rank applies it, then
takes the step (engine/sharded/lockstep.py, the engine thread). Inside a step the remaining
inputs are agreed where they arise: the sampled tokens are rank 0's
(group.Channel.agree_tokens), a disk hit is used only when every rank's disk has it,
and the startup probe's verdicts are combined. The stores then hold the same entries
(each for its own shard: in tensor mode every rank's cache has the same size); a
digest of each rank's engine state travels with every plan and a difference stops the
group rather than serve from caches that no longer agree.

This module is the callers' side and the failure path. Rank 0 serves HTTP; the others
have no callers. Failure: a collective with a rank that is gone raises; any failed step
may have left the ranks' collectives out of step, so either ends the group: every
request in flight gets an error, new ones a 503 (`failure`), and the server exits
non-zero so the launcher's supervisor can restart it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

from mlx_prefix.cache.types import EvictOutcome
from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.engine.engine import SHUTDOWN_SAVES_S
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.engine.requests.jobs import Job, WarmResult
from mlx_prefix.engine.sharded.lockstep import Asked, Diverged, Lockstep, PlannedPace, drain
from mlx_prefix.engine.sharded.plan import CacheAction, LatchedHandle, TurnPlan
from mlx_prefix.errors import Unavailable
from mlx_prefix.group import Channel, Cluster
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.records import ErrorEvent

log = logging.getLogger("mlx_prefix.engine")

ACTION_TIMEOUT_S = 60.0  # a cache action waits this long for the engine's next turn


QUANTIZED_KV_SHARDED = (
    "--kv-bits is not supported on a model sharded over ranks (a quantized KV row "
    "decodes unbatched, and that path is not built for the group's agreed steps)"
)


class DistributedEngine(Lockstep):
    handle_type = LatchedHandle

    def __init__(
        self,
        model: LoadedModel,
        cluster: Cluster,
        channel: Channel,
        cache_config: CacheConfig | None = None,
        engine_config: EngineConfig | None = None,
        disk_config: DiskConfig | None = None,
    ):
        if engine_config is not None and engine_config.kv_bits is not None:
            raise ValueError(QUANTIZED_KV_SHARDED)
        self.cluster = cluster
        self.channel = channel
        self.failure: str | None = None  # why the group stopped (None: serving)
        self._failing = threading.Lock()  # the engine thread and the watch may both fail it
        self._ended = threading.Event()  # the group stopped as asked: closing peers are fine
        self._released = threading.Event()  # the thread waits for this __init__ to end
        self._asked: queue.SimpleQueue[Asked] = queue.SimpleQueue()
        self._turn_asked: list[Asked] = []  # rank 0: the actions of the current plan
        self._live: dict[int, Job] = {}  # rank 0's serial -> job, until the job ends
        self._turn = TurnPlan(now=time.monotonic(), budget=0)
        self._stop_asked = False
        self._in_turn = False
        super().__init__(
            model, cache_config, engine_config, disk_config=per_rank(disk_config, cluster)
        )
        self._own_pace = self._pace
        self._pace = PlannedPace(self._own_pace, lambda: self._turn.budget)  # type: ignore[assignment]
        self._waiting.clock = lambda: self._turn.now
        self._decode.agree_tokens = channel.agree_tokens
        if self.disk is not None:
            self.disk.agree = lambda value: len(set(channel.gather(value))) == 1
        if not cluster.leader and self._prefetcher is not None:
            self._prefetcher.close()  # rank 0's prefetches arrive as jobs in the plans
            self._prefetcher = None
        self._released.set()

    # The base engine reads `_stopping` inside steps; shutdown() sets it from another
    # thread. Here the setter only asks, and the turn's plan says.
    @property
    def _stopping(self) -> bool:  # type: ignore[override]
        return self._turn.stopping

    @_stopping.setter
    def _stopping(self, value: bool) -> None:
        self._stop_asked = value

    # -- caller side (rank 0) -------------------------------------------------------
    def submit(self, *args: Any, **kwargs: Any) -> RequestHandle:
        self._check_serving()
        return super().submit(*args, **kwargs)

    def start_warm(self, *args: Any, **kwargs: Any) -> tuple[RequestHandle, Future[WarmResult]]:
        self._check_serving()
        return super().start_warm(*args, **kwargs)

    def cache_stats(self) -> dict:
        stats = super().cache_stats()
        stats["distributed"] = self.cluster.as_dict()
        return stats

    def flush_cache(self, namespace: str | None = None) -> int:
        return self._act(CacheAction("flush", namespace=namespace))

    def set_pinned(self, entry_id: int, pinned: bool) -> bool:
        return self._act(CacheAction("pin" if pinned else "unpin", entry_id))

    def evict_entry(self, entry_id: int) -> EvictOutcome:
        return self._act(CacheAction("evict", entry_id))

    def shutdown(self, timeout: float = 10.0, save_timeout: float = SHUTDOWN_SAVES_S) -> None:
        if self.failure is None:
            super().shutdown(timeout, save_timeout)
            return
        # The engine thread may sit in a collective with a dead rank for good.
        if self._prefetcher is not None:
            self._prefetcher.close()
        self.lifecycle.close()
        self._thread.join(1.0)

    def lost(self, rank: int) -> None:
        """The watch connection to `rank` closed (group watch thread, watch.py): unless the
        group stopped as asked, it is over. The engine thread may be stuck in a collective
        with that rank, so the requests in flight are ended from here."""
        if self._ended.is_set() or not self._set_failure(
            ConnectionError(f"rank {rank}'s connection closed")
        ):
            return
        waiting, _ = self.lifecycle.take(block=False)
        self._end_known(waiting)
        self._fail_actions()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the engine thread to end; True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _check_serving(self) -> None:
        if self.failure is not None:
            raise Unavailable(self.failure)

    def _act(self, action: CacheAction) -> Any:
        """Have every rank apply a cache action at the same point; rank 0's result."""
        self._check_serving()
        if not self._thread.is_alive():
            raise Unavailable("the engine has stopped")
        asked = Asked(action, Future())
        self._asked.put(asked)
        self.lifecycle.wake()
        try:
            return asked.future.result(ACTION_TIMEOUT_S)
        except FutureTimeout:
            raise Unavailable("the engine did not take the cache action in time") from None

    # -- the group's end (the engine thread, or the watch's `lost`) ---------------------
    def _fail(self, error: BaseException) -> None:
        """Engine thread: the group cannot go on. End every job with one clear error;
        new ones are refused."""
        self._set_failure(error)
        self._in_turn = False
        try:
            self._take_inbox(block=False)
            self._fail_all(Unavailable(self.failure or ""), waiting_too=True)
        except Exception:  # noqa: BLE001 - the engine's records may be half-updated
            log.exception("while ending the requests in flight")
        # A job rank 0 took into a plan whose exchange failed is in no phase yet:
        # `_live` alone knows it (its caller's stream would wait for good).
        self._end_known([])
        self._fail_actions()

    def _end_known(self, jobs: list[Job]) -> None:
        """End `jobs` and every job a plan has listed, with the group's failure (a job
        already ended is left as it is)."""
        event = ErrorEvent(self.failure or "")
        for job in [*list(self._live.values()), *jobs]:
            self.lifecycle.end(job, event)

    def _set_failure(self, error: BaseException) -> bool:
        """Record why the group stopped (the first reason wins); False if it already had."""
        with self._failing:
            if self.failure is not None:
                return False
            self.failure = failure_line(error, self.cluster.rank)
        log.error("%s", self.failure)
        self.lifecycle.stop_accepting()
        return True

    def _fail_actions(self) -> None:
        unavailable = Unavailable(self.failure or "")
        for asked in [*self._turn_asked, *drain(self._asked)]:
            if not asked.future.done():
                asked.future.set_exception(unavailable)


def per_rank(disk: DiskConfig | None, cluster: Cluster) -> DiskConfig | None:
    """Each rank's disk tier in a folder of its own, named by rank and world size: a
    restart with another world size finds no files (its keys differ too)."""
    if disk is None or disk.scope == "off":
        return disk
    return replace(disk, directory=str(disk.path() / f"rank{cluster.rank}-of-{cluster.size}"))


def failure_line(error: BaseException, rank: int) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, Diverged):
        what = f"the ranks' caches no longer agree ({text})"
    elif any(word in text for word in ("peer", "connection", "Socket", "[ring]", "[jaccl]")):
        what = f"a rank of the group is gone ({text})"
    else:
        what = f"a step failed on rank {rank} ({type(error).__name__}: {text})"
    return f"sharded engine stopped: {what}; restart the group with mlx.launch"
