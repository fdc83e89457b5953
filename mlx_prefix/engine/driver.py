"""The turn driver, how the engine thread takes its turns: the part of an engine that
a sharded group replaces (engine/sharded/lockstep.py). `LocalTurns` is one process's:
jobs come from the inbox, one turn after the other, until the shutdown.

A driver owns the engine's inbox (the Lifecycle) and decides what reaches a turn, and
when: the jobs, the cancels, the cache actions (`act`), the shutdown's flags, whether a
queued disk save is written. It also hands the engine's construction what differs
between one process and a group: the handle callers get, the clock of background jobs,
the prefill pace. What a group's ranks must settle together inside a turn (sampled
tokens, disk hits) is its own `Consensus`, the sharded driver's: one process has none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.cache_views import CacheAction, CacheViews
from mlx_prefix.engine.loop import EngineLoop, Pacing
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.engine.requests.lifecycle import Lifecycle
from mlx_prefix.engine.requests.pace import Pace
from mlx_prefix.platform import trim_heap

log = logging.getLogger("mlx_prefix.engine")


@dataclass(frozen=True)
class Consensus:
    """What a sharded group's ranks settle together inside a turn (collectives, on the
    engine thread): the sharded driver's (engine/sharded/lockstep.py), handed to the
    engine beside it."""

    tokens: Callable[[mx.array], mx.array]  # the sampled tokens every rank goes on with
    same: Callable[[int], bool]  # whether every rank has this value (a disk hit is used then)


class Turns(Protocol):
    @property
    def lifecycle(self) -> Lifecycle:
        """The inbox callers put jobs into."""
        ...

    @property
    def pace(self) -> Pacing:
        """Each turn's prefill budget (engine/requests/pace.py)."""
        ...

    @property
    def handle_type(self) -> type[RequestHandle]:
        """What callers hold for each job."""
        ...

    @property
    def leader(self) -> bool:
        """Whether this engine serves callers and prefetches their next turns (a sharded
        group's other ranks only follow rank 0's plans)."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving for good (a sharded group lost a rank); None:
        serving."""
        ...

    def clock(self) -> float:
        """When background jobs may start (monotonic seconds)."""
        ...

    def run(self, loop: EngineLoop, views: CacheViews) -> None:
        """The engine thread: calibrate `loop`, then its turns until the shutdown."""
        ...

    def act(self, action: CacheAction, views: CacheViews) -> Any:
        """A caller's cache action (any thread); its result."""
        ...

    def describe(self) -> dict[str, Any]:
        """What cache_stats adds about the turns (a sharded group: its ranks)."""
        ...

    def stop(self) -> None:
        """The shutdown's grace period is over: cancel the running requests too."""
        ...

    def abandon_saves(self) -> None:
        """The shutdown's time for queued disk saves is over: drop them."""
        ...


class LocalTurns:
    """One process's turns: take the inbox, step, publish, until closed and drained;
    going idle after work, the heap trimmed once (`EngineConfig.idle_trim_s`)."""

    handle_type = RequestHandle
    leader = True
    failure = None

    def __init__(self, config: EngineConfig):
        self.lifecycle = Lifecycle(config.max_queued)
        self.pace = Pace(config)
        self._stopping = False  # set by a caller's shutdown, read by the engine thread
        self._abandon_saves = False

    def clock(self) -> float:
        return time.monotonic()

    def act(self, action: CacheAction, views: CacheViews) -> Any:
        return views.apply(action)  # the store and the disk tier are thread-safe

    def describe(self) -> dict[str, Any]:
        return {}

    def stop(self) -> None:
        self._stopping = True

    def abandon_saves(self) -> None:
        self._abandon_saves = True

    def run(self, loop: EngineLoop, views: CacheViews) -> None:
        try:
            loop.calibrate()
            self._turns(loop)
        finally:
            loop.close_out()

    def _turns(self, loop: EngineLoop) -> None:
        disk = loop.disk
        trim_s = loop.config.idle_trim_s
        worked = False  # since the heap was last trimmed
        while True:
            idle = loop.idle()
            worked = worked or not idle
            saving = disk is not None and disk.pending > 0
            if disk is not None and saving and self._abandon_saves:
                disk.drop_pending("the shutdown's time for disk saves ran out")
                saving = False
            if loop.closing and idle and not saving:
                return  # queued saves are written first: a shutdown keeps what disk should
            try:
                if disk is not None and saving:
                    # Off the requests' critical path: never between two tokens.
                    disk.write_pending(busy=not idle, decoding=len(loop.decode) > 0)
                block = idle and not loop.closing and not saving
                wait = loop.waiting.background_wait() if block else None
                # Idle after work: wait a moment first (never between two requests of a
                # burst), unless a background prefill is due sooner; then give the C
                # heap's freed pages back once (glibc keeps ~100 MiB after a burst).
                trim = block and worked and trim_s is not None and (wait is None or wait >= trim_s)
                loop.take_inbox(block, timeout=trim_s if trim else wait)
                if trim and not loop.waiting.has_requests():
                    trim_heap()  # once per idle transition, off every request's path
                    worked = False
                loop.step(self._stopping)
            except Exception as e:  # a bug in one request must not stop the engine
                log.exception("engine step failed")
                loop.fail_all(e)
            loop.publish()
