"""The turns of a sharded engine (a turn driver, engine/driver.py): every rank takes the
same turns in lockstep, rank 0 decides.

Once per turn, before any forward, rank 0 gathers the turn's inputs into a plan
(engine/sharded/plan.py: new jobs with their seeds drawn, latched cancels, its clock and
prefill budget, cache actions, disk-save timing, shutdown flags); every rank exchanges
it together with a digest of its engine state, applies it, then takes the engine loop's
step (engine/loop.py). A digest that differs raises Diverged: the group stops rather
than serve from caches that no longer agree. The startup calibration is combined
across ranks: the least row count, and batching only where it held on every rank. An
idle rank 0 still sends a plan every HEARTBEAT_S, so a lost rank shows without traffic.
What ends the group, and how the requests in flight end then, is GroupFailure's
(engine/sharded/failure.py).
"""

from __future__ import annotations

import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.cache_views import CacheAction, CacheViews
from mlx_prefix.engine.calibration import Agreement
from mlx_prefix.engine.decode.constraints import ConstraintFactory
from mlx_prefix.engine.driver import Consensus
from mlx_prefix.engine.forward.rowwise import Grouping
from mlx_prefix.engine.loop import EngineLoop, Pacing
from mlx_prefix.engine.probe import ProbeResult
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.engine.requests.lifecycle import Lifecycle
from mlx_prefix.engine.requests.pace import Pace
from mlx_prefix.engine.sharded.failure import Asked, Diverged, GroupFailure, drain
from mlx_prefix.engine.sharded.group import Channel, Cluster
from mlx_prefix.engine.sharded.plan import JobSpec, LatchedHandle, TurnPlan
from mlx_prefix.errors import Unavailable

HEARTBEAT_S = 2.0  # an idle rank 0 exchanges a plan at least this often
ACTION_TIMEOUT_S = 60.0  # a cache action waits this long for the engine's next turn


class RankAgreement(Agreement):
    """The ranks' calibrations combined: the least row count, and batching only where
    it held on every rank."""

    def __init__(self, channel: Channel):
        self.channel = channel

    def rows(self, found: list[Grouping]) -> list[Grouping]:
        # Every rank groups each layer's rows alike: a sharded layer sums over the ranks
        # once per group.
        if len(set(self.channel.gather(len(found)))) > 1:  # shapes differ between ranks
            least = min(self.channel.gather(min((g.as_rows for g in found), default=1)))
            return [Grouping(least)] * len(found)
        return [
            Grouping(min(self.channel.gather(g.as_rows)), min(self.channel.gather(g.as_columns)))
            for g in found
        ]

    def verdicts(self, checked: ProbeResult) -> ProbeResult:
        votes = self.channel.gather(int(checked.stacked_prefill) | 2 * int(checked.batched_decode))
        return ProbeResult(all(v & 1 for v in votes), all(v & 2 for v in votes))


class PlannedPace:
    """Prefill budgets from the turn's plan (rank 0's measurements); this rank's own
    timings still feed its Pace, which rank 0 reads when it plans."""

    def __init__(self, own: Pace, budget: Callable[[], int]):
        self.own = own
        self._budget = budget

    def prefill_budget(self, decoding: int) -> int:
        return self._budget()

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.own.prefilled(tokens, seconds)

    def decoded(self, seconds: float) -> None:
        self.own.decoded(seconds)


class Lockstep:
    handle_type = LatchedHandle  # a caller's cancel reaches every rank through a plan

    def __init__(self, cluster: Cluster, channel: Channel, config: EngineConfig):
        self.cluster = cluster
        self.channel = channel
        self.leader = cluster.leader
        self.lifecycle = Lifecycle(config.max_queued)
        self._own_pace = Pace(config)  # rank 0 plans each turn's budget from its own
        self.pace: Pacing = PlannedPace(self._own_pace, lambda: self._turn.budget)
        # What the ranks settle inside a turn: the engine's, beside these turns.
        self.consensus = Consensus(tokens=channel.agree_tokens, same=self.agree)
        self._asked: queue.SimpleQueue[Asked] = queue.SimpleQueue()
        self._turn_asked: list[Asked] = []  # rank 0: the actions of the current plan
        self._live: dict[int, Job] = {}  # rank 0's serial -> job, until the job ends
        self.ending = GroupFailure(cluster.rank, self.lifecycle, self._live, self._asked)
        self._turn = TurnPlan(now=time.monotonic(), budget=0)
        self._stop_asked = False  # shutdown's ask; the plan says when every rank stops
        self._abandon_saves = False
        self._done = threading.Event()  # the engine thread's turns are over

    # -- what the engine's construction and its callers ask (any thread) -------------
    @property
    def failure(self) -> str | None:
        return self.ending.failure

    def agree(self, value: int) -> bool:
        """Whether every rank has the same `value` (a collective: engine thread)."""
        return len(set(self.channel.gather(value))) == 1

    def clock(self) -> float:
        return self._turn.now  # rank 0's clock, as of the turn's plan

    def describe(self) -> dict[str, Any]:
        return {"distributed": self.cluster.as_dict()}

    def stop(self) -> None:
        self._stop_asked = True

    def abandon_saves(self) -> None:
        self._abandon_saves = True

    def act(self, action: CacheAction, views: CacheViews) -> Any:
        """Have every rank apply a cache action at the same point; rank 0's result."""
        if self.failure is not None:
            raise Unavailable(self.failure)
        if self._done.is_set():
            raise Unavailable("the engine has stopped")
        asked = Asked(action, Future())
        self._asked.put(asked)
        self.lifecycle.wake()
        try:
            return asked.future.result(ACTION_TIMEOUT_S)
        except FutureTimeout:
            raise Unavailable("the engine did not take the cache action in time") from None

    def lost(self, rank: int) -> None:
        """The watch connection to `rank` closed (watch.py's thread): see GroupFailure."""
        self.ending.lost(rank, self._turn_asked)

    # -- the engine thread ------------------------------------------------------------
    def run(self, loop: EngineLoop, views: CacheViews) -> None:
        try:
            # Combined across the ranks (--deterministic; the plain default measures
            # nothing to agree on).
            loop.calibrate(RankAgreement(self.channel))
            if self.cluster.leader:
                self._lead(loop, views)
            else:
                self._follow(loop, views)
        except Exception as e:  # noqa: BLE001 - a rank gone, say: the group is over
            self.ending.fail(e, loop, self._turn_asked)
        finally:
            self._done.set()
            loop.close_out()

    def _lead(self, loop: EngineLoop, views: CacheViews) -> None:
        disk = loop.disk
        while self.failure is None:
            idle = loop.idle()
            saving = disk is not None and disk.pending > 0
            drop = saving and self._abandon_saves
            saving = saving and not drop
            if loop.closing and idle and not saving:
                self.ending.ended.set()
                self._exchange(TurnPlan(time.monotonic(), 0, stop=True), loop, views)
                return
            block = idle and not loop.closing and not saving
            jobs, closing = self.lifecycle.take(block, self._idle_wait(loop) if block else None)
            write = saving and disk is not None and disk.due(not idle, len(loop.decode) > 0)
            plan = self._gather(jobs, closing, write, drop, loop)
            self._exchange(plan, loop, views)
            self._turn_step(plan, jobs, loop, views)

    def _follow(self, loop: EngineLoop, views: CacheViews) -> None:
        constraints = ConstraintFactory(loop.model.tokenizer)  # its jobs' grammars, built here
        while self.failure is None:
            plan = self._exchange(None, loop, views)
            if plan.stop:
                self.ending.ended.set()
                return
            now = time.perf_counter()
            self._turn_step(plan, [spec.job(now, constraints) for spec in plan.jobs], loop, views)

    def _gather(
        self, jobs: list[Job], closing: bool, write: bool, drop: bool, loop: EngineLoop
    ) -> TurnPlan:
        """Rank 0: this turn's inputs, frozen (mutates the jobs' seeds and cancels)."""
        for job in jobs:
            if job.sampling.seed is None:  # drawn once here, used by every rank's sampler
                job.sampling = replace(job.sampling, seed=random.getrandbits(63))
        cancels = tuple(
            j.serial
            for j in [*self._live.values(), *jobs]
            if isinstance(j.handle, LatchedHandle) and j.handle.latch()
        )
        self._turn_asked = drain(self._asked)
        # Listed now, not at the turn's step: a group lost during the exchange still
        # ends them (GroupFailure).
        self._live.update((j.serial, j) for j in jobs)
        return TurnPlan(
            now=time.monotonic(),
            budget=self._own_pace.prefill_budget(len(loop.decode)),
            jobs=tuple(JobSpec.of(j) for j in jobs),
            cancels=cancels,
            actions=tuple(a.action for a in self._turn_asked),
            write_save=write,
            drop_saves=drop,
            closing=closing,
            stopping=self._stop_asked,
        )

    def _exchange(self, plan: TurnPlan | None, loop: EngineLoop, views: CacheViews) -> TurnPlan:
        """Rank 0 passes its plan, the others None; every rank gets the plan, after
        checking that every rank's engine state is the same."""
        raw, digests = self.channel.exchange(
            plan.encode() if plan is not None else None, digest(loop, views)
        )
        if len(set(digests)) > 1:
            raise Diverged(f"state digests by rank: {', '.join(f'{d:x}' for d in digests)}")
        return plan if plan is not None else TurnPlan.decode(raw)

    def _turn_step(
        self, plan: TurnPlan, jobs: list[Job], loop: EngineLoop, views: CacheViews
    ) -> None:
        """Apply a plan, then take the loop's step (every rank alike). Jobs join at turn
        starts only, through the plan: a look at the inbox inside the step would let
        rank 0 start a job the others do not know of."""
        self._turn = plan
        self._do_actions(plan.actions, views)
        if loop.disk is not None:
            if plan.drop_saves:
                loop.disk.drop_pending("the shutdown's time for disk saves ran out")
            if plan.write_save:
                loop.disk.write_pending(busy=False)
        self._live.update((j.serial, j) for j in jobs)
        loop.add(jobs, plan.closing)
        for serial in plan.cancels:
            if (job := self._live.get(serial)) is not None:
                job.handle.cancelled.set()
        loop.step(plan.stopping, arrivals=False)
        for serial in [s for s, j in self._live.items() if j.ended]:
            del self._live[serial]  # in place: GroupFailure reads the same dict
        if self.cluster.leader:
            loop.publish()

    def _do_actions(self, actions: tuple[CacheAction, ...], views: CacheViews) -> None:
        for i, action in enumerate(actions):
            result: Any = None
            error: Exception | None = None
            try:
                result = views.apply(action)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                error = e
            if self.cluster.leader:
                future = self._turn_asked[i].future
                future.set_exception(error) if error else future.set_result(result)
        self._turn_asked = []

    def _idle_wait(self, loop: EngineLoop) -> float:
        """How long an idle rank 0 waits for a job: until a background job may start,
        at most HEARTBEAT_S."""
        times = [j.not_before for j in loop.waiting if j.background]
        wait = min(times) - time.monotonic() if times else HEARTBEAT_S
        return min(max(wait, 0.0), HEARTBEAT_S)


def digest(loop: EngineLoop, views: CacheViews) -> int:
    """What every rank's engine must agree on at a turn's start."""
    s = views.store.stats()
    disk = loop.disk
    state = (
        s.entries, s.bytes, s.active_bytes, s.evictions, s.hits, s.misses, s.pinned,
        len(loop.waiting), len(loop.prefill.tasks), len(loop.decode), loop.decode.steps,
        disk.pending if disk is not None else 0,
    )  # fmt: skip
    return zlib.crc32(repr(state).encode())
