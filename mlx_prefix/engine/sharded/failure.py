"""How a sharded group ends (engine/sharded/lockstep.py's turns): a collective with a
rank that is gone raises, and any failed step may have left the ranks' collectives out
of step, so either ends the group: every request in flight gets an error, new ones a
503 (`failure`), and the server exits non-zero so the launcher's supervisor can restart
it. The engine thread may be stuck in a collective with the dead rank for good, so the
watch's `lost` (watch.py) ends the requests in flight from its own thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from mlx_prefix.engine.cache_views import CacheAction
from mlx_prefix.engine.loop import EngineLoop
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.engine.requests.lifecycle import Lifecycle
from mlx_prefix.errors import Unavailable
from mlx_prefix.records import ErrorEvent

log = logging.getLogger("mlx_prefix.engine")


class Diverged(RuntimeError):
    """The ranks' engine states differ: their caches no longer hold the same entries."""


@dataclass(slots=True)
class Asked:
    """A cache action a caller asked rank 0 for, and the future its caller waits on."""

    action: CacheAction
    future: Future


class GroupFailure:
    """Why the group stopped, once, and the ending of everything in flight then."""

    def __init__(
        self,
        rank: int,
        lifecycle: Lifecycle,
        live: dict[int, Job],
        asked: queue.SimpleQueue[Asked],
    ):
        self.rank = rank
        self.lifecycle = lifecycle
        self.live = live  # the jobs rank 0's plans listed (the turns keep it current)
        self.asked = asked  # cache actions callers asked for, not yet in a plan
        self.failure: str | None = None  # why the group stopped (None: serving)
        self._failing = threading.Lock()  # the engine thread and the watch may both fail it
        self.ended = threading.Event()  # the group stopped as asked: closing peers are fine

    def fail(self, error: BaseException, loop: EngineLoop, turn_asked: list[Asked]) -> None:
        """Engine thread: the group cannot go on. End every job with one clear error;
        new ones are refused."""
        self._set_failure(error)
        try:
            loop.take_inbox(block=False)
            loop.fail_all(Unavailable(self.failure or ""), waiting_too=True)
        except Exception:  # noqa: BLE001 - the engine's records may be half-updated
            log.exception("while ending the requests in flight")
        # A job rank 0 took into a plan whose exchange failed is in no phase yet:
        # `live` alone knows it (its caller's stream would wait for good).
        self._end_known([])
        self._fail_actions(turn_asked)

    def lost(self, rank: int, turn_asked: list[Asked]) -> None:
        """The watch connection to `rank` closed (watch.py's thread): unless the group
        stopped as asked, it is over. The engine thread may be stuck in a collective
        with that rank, so the requests in flight are ended from here."""
        if self.ended.is_set() or not self._set_failure(
            ConnectionError(f"rank {rank}'s connection closed")
        ):
            return
        waiting, _ = self.lifecycle.take(block=False)
        self._end_known(waiting)
        self._fail_actions(turn_asked)

    def _end_known(self, jobs: list[Job]) -> None:
        """End `jobs` and every job a plan has listed, with the group's failure (a job
        already ended is left as it is)."""
        event = ErrorEvent(self.failure or "")
        for job in [*list(self.live.values()), *jobs]:
            self.lifecycle.end(job, event)

    def _set_failure(self, error: BaseException) -> bool:
        """Record why the group stopped (the first reason wins); False if it already had."""
        with self._failing:
            if self.failure is not None:
                return False
            self.failure = failure_line(error, self.rank)
        log.error("%s", self.failure)
        self.lifecycle.stop_accepting()
        return True

    def _fail_actions(self, turn_asked: list[Asked]) -> None:
        unavailable = Unavailable(self.failure or "")
        for asked in [*turn_asked, *drain(self.asked)]:
            if not asked.future.done():
                asked.future.set_exception(unavailable)


def drain(q: queue.SimpleQueue[Asked]) -> list[Asked]:
    out: list[Asked] = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def failure_line(error: BaseException, rank: int) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, Diverged):
        what = f"the ranks' caches no longer agree ({text})"
    elif any(word in text for word in ("peer", "connection", "Socket", "[ring]", "[jaccl]")):
        what = f"a rank of the group is gone ({text})"
    else:
        what = f"a step failed on rank {rank} ({type(error).__name__}: {text})"
    return f"sharded engine stopped: {what}; restart the group with mlx.launch"
