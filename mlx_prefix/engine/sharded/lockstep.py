"""The engine thread of a sharded engine (engine/sharded/distributed.py): every rank takes the
same turns in lockstep, rank 0 decides.

Once per turn, before any forward, rank 0 gathers the turn's inputs into a plan
(engine/sharded/plan.py: new jobs with their seeds drawn, latched cancels, its clock and
prefill budget, cache actions, disk-save timing, shutdown flags); every rank exchanges
it together with a digest of its engine state, applies it, then takes the base
engine's step (engine/loop.py). A digest that differs raises Diverged: the group
stops rather than serve from caches that no longer agree. The startup calibration is
combined across ranks: the least row count, and batching only where it held on every
rank. An idle rank 0 still sends a plan every HEARTBEAT_S, so a lost rank shows
without traffic.
"""

from __future__ import annotations

import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from mlx_prefix.engine.calibration import PLAIN, Agreement, calibrate
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.forward.rowwise import Grouping
from mlx_prefix.engine.probe import ProbeResult
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.engine.requests.pace import Pace
from mlx_prefix.engine.sharded.plan import CacheAction, JobSpec, LatchedHandle, TurnPlan
from mlx_prefix.group import Channel, Cluster

HEARTBEAT_S = 2.0  # an idle rank 0 exchanges a plan at least this often


class Diverged(RuntimeError):
    """The ranks' engine states differ: their caches no longer hold the same entries."""


@dataclass(slots=True)
class Asked:
    """A cache action a caller asked rank 0 for, and the future its caller waits on."""

    action: CacheAction
    future: Future


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


class Lockstep(Engine):
    """The engine thread's turns; DistributedEngine adds the construction, the callers'
    side and the failure path."""

    cluster: Cluster
    channel: Channel
    failure: str | None
    _ended: threading.Event
    _released: threading.Event
    _asked: queue.SimpleQueue[Asked]
    _turn_asked: list[Asked]
    _live: dict[int, Job]
    _turn: TurnPlan
    _stop_asked: bool
    _in_turn: bool
    _own_pace: Pace
    _fail: Callable[[BaseException], None]

    def _loop(self) -> None:
        self._released.wait()
        super()._loop()

    def _calibrate(self) -> None:
        """The base engine's calibration, in lockstep, with every rank's verdicts combined
        (--deterministic; the plain default measures nothing to agree on)."""
        if not self.config.deterministic:
            self._calibrated(PLAIN)
            return
        try:
            found = calibrate(self.model, RankAgreement(self.channel))
        except Exception as e:  # noqa: BLE001 - a rank gone, say: the group is over
            self._fail(e)
            return
        self._calibrated(found)

    def _run_until_closed(self) -> None:
        if self.failure is not None:
            return
        try:
            if self.cluster.leader:
                self._lead()
            else:
                self._follow()
        except Exception as e:  # noqa: BLE001 - the group ends (engine/sharded/distributed.py)
            self._fail(e)

    def _lead(self) -> None:
        while self.failure is None:
            idle = self._idle()
            saving = self.disk is not None and self.disk.pending > 0
            drop = saving and self._abandon_saves
            saving = saving and not drop
            if self._closing and idle and not saving:
                self._ended.set()
                self._exchange(TurnPlan(time.monotonic(), 0, stop=True))
                return
            block = idle and not self._closing and not saving
            jobs, closing = self.lifecycle.take(block, self._idle_wait() if block else None)
            decoding = len(self._decode) > 0
            write = saving and self.disk is not None and self.disk.due(not idle, decoding)
            plan = self._gather(jobs, closing, write, drop)
            self._exchange(plan)
            self._turn_step(plan, jobs)

    def _follow(self) -> None:
        while self.failure is None:
            plan = self._exchange(None)
            if plan.stop:
                self._ended.set()
                return
            now = time.perf_counter()
            self._turn_step(plan, [spec.job(now, self.constraints) for spec in plan.jobs])

    def _gather(self, jobs: list[Job], closing: bool, write: bool, drop: bool) -> TurnPlan:
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
        # ends them (`lost`).
        self._live.update((j.serial, j) for j in jobs)
        return TurnPlan(
            now=time.monotonic(),
            budget=self._own_pace.prefill_budget(len(self._decode)),
            jobs=tuple(JobSpec.of(j) for j in jobs),
            cancels=cancels,
            actions=tuple(a.action for a in self._turn_asked),
            write_save=write,
            drop_saves=drop,
            closing=closing,
            stopping=self._stop_asked,
        )

    def _exchange(self, plan: TurnPlan | None) -> TurnPlan:
        """Rank 0 passes its plan, the others None; every rank gets the plan, after
        checking that every rank's engine state is the same."""
        raw, digests = self.channel.exchange(
            plan.encode() if plan is not None else None, self._digest()
        )
        if len(set(digests)) > 1:
            raise Diverged(f"state digests by rank: {', '.join(f'{d:x}' for d in digests)}")
        return plan if plan is not None else TurnPlan.decode(raw)

    def _turn_step(self, plan: TurnPlan, jobs: list[Job]) -> None:
        """Apply a plan, then take the base engine's step (every rank alike)."""
        self._turn = plan
        self._do_actions(plan.actions)
        if self.disk is not None:
            if plan.drop_saves:
                self.disk.drop_pending("the shutdown's time for disk saves ran out")
            if plan.write_save:
                self.disk.write_pending(busy=False)
        self._waiting.add(jobs)
        self._live.update((j.serial, j) for j in jobs)
        for serial in plan.cancels:
            if (job := self._live.get(serial)) is not None:
                job.handle.cancelled.set()
        self._closing = self._closing or plan.closing
        if self._closing:
            for job in self._waiting:
                job.handle.cancelled.set()
        self._in_turn = True
        try:
            self._step()
        finally:
            self._in_turn = False
        self._live = {s: j for s, j in self._live.items() if not j.ended}
        if self.cluster.leader:
            self._board.publish(
                self._waiting, self._prefill.tasks, self._decode.running(), self.capacity
            )

    def _take_inbox(self, block: bool, timeout: float | None = None) -> None:
        # Jobs join at turn starts, through the plan; the base step's mid-turn look at
        # the inbox would let rank 0 start a job the others do not know of.
        if not self._in_turn:
            super()._take_inbox(block, timeout)

    def _do_actions(self, actions: tuple[CacheAction, ...]) -> None:
        for i, action in enumerate(actions):
            result: Any = None
            error: Exception | None = None
            try:
                result = self._apply(action)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                error = e
            if self.cluster.leader:
                future = self._turn_asked[i].future
                future.set_exception(error) if error else future.set_result(result)
        self._turn_asked = []

    def _apply(self, action: CacheAction) -> Any:
        if action.name == "flush":
            return Engine.flush_cache(self, action.namespace)
        if action.name in ("pin", "unpin"):
            return Engine.set_pinned(self, action.entry_id, action.name == "pin")
        if action.name == "evict":
            return Engine.evict_entry(self, action.entry_id)
        raise ValueError(f"unknown cache action {action.name!r}")

    def _digest(self) -> int:
        """What every rank's engine must agree on at a turn's start."""
        s = self.store.stats()
        state = (
            s.entries, s.bytes, s.active_bytes, s.evictions, s.hits, s.misses, s.pinned,
            len(self._waiting), len(self._prefill.tasks), len(self._decode), self._decode.steps,
            self.disk.pending if self.disk is not None else 0,
        )  # fmt: skip
        return zlib.crc32(repr(state).encode())

    def _idle(self) -> bool:
        return not (self._waiting.has_requests() or self._prefill.tasks or len(self._decode))

    def _idle_wait(self) -> float:
        """How long an idle rank 0 waits for a job: until a background job may start,
        at most HEARTBEAT_S."""
        times = [j.not_before for j in self._waiting if j.background]
        wait = min(times) - time.monotonic() if times else HEARTBEAT_S
        return min(max(wait, 0.0), HEARTBEAT_S)


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


def drain(q: queue.SimpleQueue[Asked]) -> list[Asked]:
    out: list[Asked] = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
