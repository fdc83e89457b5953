"""DistributedEngine: the engine of a model sharded over the ranks of an `mlx.launch`
group. Every rank runs the same engine steps on its own shard; rank 0 decides.

A forward of a sharded model is a collective: every rank must run the same forwards,
with the same shapes, in the same order. So every rank runs this engine, with the same
code for matching, restoring, prefill chunks, checkpoints, eviction and decoding, and
every input that is not already the same on every rank comes from rank 0: once per
turn, before any forward, rank 0 sends the turn's plan (engine/turns.py: new jobs,
latched cancels, its clock and prefill budget, cache actions, disk-save timing,
shutdown flags) and every rank applies it, then takes the step. Inside a step the
remaining inputs are agreed where they arise: the sampled tokens are rank 0's
(group.Channel.agree_tokens), a disk hit is used only when every rank's disk has it,
and the startup probe's verdicts are combined. The stores then hold the same entries
(each for its own shard: in tensor mode every rank's cache has the same size); a
digest of each rank's engine state travels with every plan and a difference stops the
group rather than serve from caches that no longer agree.

Rank 0 serves HTTP; the others have no callers. Failure: a collective with a rank that
is gone raises; any failed step may have left the ranks' collectives out of step, so
either ends the group: every request in flight gets an error, new ones a 503
(`failure`), and the server exits non-zero so the launcher's supervisor can restart it.
An idle rank 0 still sends a plan every HEARTBEAT_S, so a lost rank shows without traffic.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

from mlx_prefix.cache.records import EvictOutcome
from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.engine import rowwise
from mlx_prefix.engine.engine import SHUTDOWN_SAVES_S, Engine
from mlx_prefix.engine.handle import RequestHandle
from mlx_prefix.engine.jobs import Job, WarmResult
from mlx_prefix.engine.pace import Pace
from mlx_prefix.engine.probe import probe
from mlx_prefix.engine.turns import CacheAction, JobSpec, LatchedHandle, TurnPlan
from mlx_prefix.errors import Unavailable
from mlx_prefix.group import Channel, Cluster
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.records import ErrorEvent

log = logging.getLogger("mlx_prefix.engine")

HEARTBEAT_S = 2.0  # an idle rank 0 exchanges a plan at least this often
ACTION_TIMEOUT_S = 60.0  # a cache action waits this long for the engine's next turn


class Diverged(RuntimeError):
    """The ranks' engine states differ: their caches no longer hold the same entries."""


@dataclass(slots=True)
class _Asked:
    action: CacheAction
    future: Future


QUANTIZED_KV_SHARDED = (
    "--kv-bits is not supported on a model sharded over ranks (a quantized KV row "
    "decodes unbatched, and that path is not built for the group's agreed steps)"
)


class DistributedEngine(Engine):
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
        self._asked: queue.SimpleQueue[_Asked] = queue.SimpleQueue()
        self._turn_asked: list[_Asked] = []  # rank 0: the actions of the current plan
        self._live: dict[int, Job] = {}  # rank 0's serial -> job, until the job ends
        self._turn = TurnPlan(now=time.monotonic(), budget=0)
        self._stop_asked = False
        self._in_turn = False
        super().__init__(
            model, cache_config, engine_config, disk_config=per_rank(disk_config, cluster)
        )
        self._own_pace = self._pace
        self._pace = _PlannedPace(self._own_pace, lambda: self._turn.budget)  # type: ignore[assignment]
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
        event = ErrorEvent(self.failure or "")
        waiting, _ = self.lifecycle.take(block=False)
        for job in [*list(self._live.values()), *waiting]:
            self.lifecycle.end(job, event)
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
        asked = _Asked(action, Future())
        self._asked.put(asked)
        self.lifecycle.wake()
        try:
            return asked.future.result(ACTION_TIMEOUT_S)
        except FutureTimeout:
            raise Unavailable("the engine did not take the cache action in time") from None

    # -- engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        self._released.wait()
        super()._loop()

    def _calibrate(self) -> None:
        """The base engine's calibration, in lockstep, with every rank's verdicts combined:
        the least row count, and batching only where it held on every rank."""
        try:
            model = self.model.model
            rowwise.install(model)
            rows = min(self.channel.gather(rowwise.consistent_rows(model)))
            checked = probe(model, rows, self.model.tokenizer.vocab_size)
            vote = int(checked.stacked_prefill) | 2 * int(checked.batched_decode)
            votes = self.channel.gather(vote)
        except Exception as e:  # noqa: BLE001 - a rank gone, say: the group is over
            self._fail(e)
            return
        self.batchable = self.batchable and all(v & 2 for v in votes)
        self._prefill.group = all(v & 1 for v in votes)
        self._decode.set_rows(rows)
        self.capacity = self.config.max_running if self.batchable else 1

    def _run_until_closed(self) -> None:
        if self.failure is not None:
            return
        try:
            if self.cluster.leader:
                self._lead()
            else:
                self._follow()
        except Exception as e:  # noqa: BLE001 - see the module docstring: the group ends
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
        self._turn_asked = _drain(self._asked)
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
        self._fail_actions()

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
        for asked in [*self._turn_asked, *_drain(self._asked)]:
            if not asked.future.done():
                asked.future.set_exception(unavailable)


class _PlannedPace:
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


def _drain(q: queue.SimpleQueue[_Asked]) -> list[_Asked]:
    out: list[_Asked] = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
