"""The engine thread's side: the object that owns the model's phases and every MLX array
(invariant 1); callers only reach it through the inbox (engine/requests/lifecycle.py).

It is built from its parts, each complete: the waiting list, the prefill phase
(engine/prefill/phase.py), the decode phase (engine/decode/phase.py) and the pace
between them. A turn driver (engine/driver.py, or engine/sharded/lockstep.py for a
sharded group) calibrates it once, then calls `step` once per turn; a step reads as
three parts: `schedule` (drop cancelled jobs, start the next prefills), the prefill
phase, the decode phase. Every job ends with exactly one final event; an error inside a
step ends the requests in flight (`fail_all`) and the engine goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.activity import ActivityBoard
from mlx_prefix.engine.calibration import PLAIN, Agreement, calibrate, check_speculator
from mlx_prefix.engine.decode.arrival import Arrival
from mlx_prefix.engine.decode.phase import DecodePhase
from mlx_prefix.engine.decode.running import HandBack
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.prefill.headroom import next_chunk_fits
from mlx_prefix.engine.prefill.phase import PrefillPhase
from mlx_prefix.engine.prefill.task import PrefillTask
from mlx_prefix.engine.requests.jobs import Job, PrefetchStats, WarmResult, cancelled
from mlx_prefix.engine.requests.lifecycle import Lifecycle, error_message
from mlx_prefix.engine.requests.pace import gathers
from mlx_prefix.engine.requests.scheduler import WaitingList
from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.records import ErrorEvent, ProgressEvent

log = logging.getLogger("mlx_prefix.engine")


class Pacing(Protocol):
    """engine/requests/pace.py's Pace, or a sharded group's (rank 0's budget)."""

    def prefill_budget(self, decoding: int) -> int: ...

    def prefilled(self, tokens: int, seconds: float) -> None: ...

    def decoded(self, seconds: float) -> None: ...


@dataclass(eq=False, repr=False)  # identity, as the one loop of its engine
class EngineLoop:
    """These methods run on the engine thread only."""

    model: LoadedModel
    config: EngineConfig
    lifecycle: Lifecycle
    waiting: WaitingList[Job]
    prefill: PrefillPhase
    decode: DecodePhase
    pace: Pacing
    disk: DiskAccess | None
    board: ActivityBoard
    prefetch: PrefetchStats  # next-turn prefetches started, completed, cancelled
    # Whether requests may decode in one batch: from the cache's layers and the
    # kernels until the calibration says more.
    batchable: bool
    capacity: int = field(default=1, init=False)  # requests decoding at once: set by `calibrate`
    # The shutdown marker was seen: cancel what waits.
    closing: bool = field(default=False, init=False)

    # -- what a turn driver calls ---------------------------------------------------
    def calibrate(self, agreement: Agreement | None = None) -> None:
        """With --deterministic, make batched forwards batch-invariant and check them on
        this model and backend (engine/calibration.py; what does not hold runs alone;
        `agreement`: how a sharded group's ranks combine what each found); requests
        submitted meanwhile wait in the inbox. Otherwise nothing is measured."""
        if not self.config.deterministic:
            found = PLAIN
        elif agreement is None:
            found = calibrate(self.model)
        else:
            found = calibrate(self.model, agreement)
        self.batchable = self.batchable and found.batched_decode
        self.prefill.group = found.stacked_prefill
        self.decode.set_rows(found.rows)
        self.capacity = self.config.max_running if self.batchable else 1
        self.lifecycle.capacity = self.capacity
        check_speculator(self.model, found.rows, self.decode.speculator)
        lookup = self.decode.lookup
        if lookup is not None and lookup.max_tokens and lookup.unusable is None:
            lookup.check(self.model, found.rows)  # at startup, not in a request's reply

    def idle(self) -> bool:
        return not (self.waiting.has_requests() or self.prefill.tasks or len(self.decode))

    def step(self, stopping: bool, arrivals: bool = True) -> None:
        """Prefill: the next grid chunks of the prefilling requests (each on its own grid,
        equal-shape chunks stacked), as many tokens as fit between two decode steps; then
        one decode step for every running request. `stopping`: the shutdown's grace
        period is over, every request is cancelled. `arrivals`: requests that arrived
        during the prefill may start in this step (a sharded group's arrive only at a
        turn's start, through the plan)."""
        self.schedule(stopping)
        if self.prefill.tasks:
            self.decode.read_launched()  # the prefill's time is its own (pace.py)
            self._prefill_step(self.pace.prefill_budget(len(self.decode)), stopping)
            # Requests that arrived meanwhile are visible to in-flight sharing at the
            # next chunk boundary, and can start right after.
            if arrivals:
                self.take_inbox(block=False)
            self.schedule(stopping)
        self._admit_held()
        if len(self.decode):
            # While prompts prefill between decode steps, a step is computed and read
            # whole: the pace weighs its time against theirs. Otherwise the next step
            # launches before this one is read (DecodeBatch.step), as mlx_lm pipelines.
            started = time.perf_counter()
            self.decode.step(stopping, overlap=not self.prefill.tasks)
            self.pace.decoded(time.perf_counter() - started)

    def take_inbox(self, block: bool, timeout: float | None = None) -> None:
        """Move submitted jobs into the waiting list (waiting up to `timeout` for one
        when `block`); after the shutdown marker, cancel what waits."""
        jobs, closing = self.lifecycle.take(block, timeout)
        self.add(jobs, closing)

    def add(self, jobs: list[Job], closing: bool) -> None:
        """Jobs join the waiting list; `closing`: the shutdown marker came with them."""
        self.waiting.add(jobs)
        self.closing = self.closing or closing
        if self.closing:
            for job in self.waiting:
                job.handle.cancelled.set()

    def publish(self) -> None:
        """What the engine is doing, for any thread to read (engine/activity.py)."""
        self.board.publish(self.waiting, self.prefill.tasks, self.decode.running(), self.capacity)

    def fail_all(self, error: Exception, waiting_too: bool = False) -> None:
        """After an unexpected error, end every request in flight with an error event:
        their state may be inconsistent. Waiting requests are unaffected unless
        `waiting_too` (the engine is going away)."""
        event = ErrorEvent(error_message(error))
        for task in list(self.prefill.tasks):
            self.lifecycle.end(self.prefill.close(task, failed=True).job, event)
        for job in self.decode.drop_all():
            self.lifecycle.end(job, event)
        if waiting_too:
            for job in self.waiting.take_if(lambda j: True):
                self.lifecycle.end(job, event)

    def close_out(self) -> None:
        """The thread's last act: normally nothing is left; if the turns themselves
        died, no request may wait forever."""
        self.lifecycle.stop_accepting()
        self.take_inbox(block=False)
        self.fail_all(MlxPrefixError("the engine stopped"), waiting_too=True)
        if self.disk is not None:
            self.disk.drop_pending("the engine stopped")
        # The thread's MLX streams stay: the thread serves the next engine
        # (mlx_threads.py destroys them when it stops).

    # -- one step's parts -----------------------------------------------------------
    def schedule(self, stopping: bool = False) -> None:
        gone = self.waiting.take_if(lambda j: j.handle.cancelled.is_set() or stopping)
        for dropped in gone:
            self.lifecycle.end(dropped, cancelled(dropped))
        for task in list(self.prefill.tasks):
            self._preempt_background(task)
        while len(self.waiting) and self._room():
            startable = lambda j: not self.prefill.waits_for_sharing(j)  # noqa: E731
            job = self.waiting.next_request(
                self.prefill.peek_reuse, self.config.max_passovers, startable
            )
            if job is not None:
                for bg in self.waiting.superseded_by(job):
                    self.lifecycle.end(bg, cancelled(bg))
            else:
                busy = len(self.decode) > 0 or bool(self.prefill.tasks)
                job = self.waiting.ready_background(decoding=busy)
                if job is None:
                    return
            try:
                started = self.prefill.start(job)
                if job.background and started:
                    self.prefetch.started += 1
                elif job.background:  # a prefetch the budget has no room for
                    self.prefetch.no_room += 1
                    self.lifecycle.end(job, cancelled(job))
            except Exception as e:
                log.exception("%s: could not start", job.handle.request_id)
                self.lifecycle.end(job, ErrorEvent(error_message(e)))

    def _room(self) -> bool:
        """Whether another request may start prefilling: it will join the decode batch."""
        busy = len(self.decode) + len(self.prefill.tasks)
        return busy < self.capacity and self.prefill.computing < self.config.max_prefilling

    def _preempt_background(self, task: PrefillTask) -> None:
        """A background prefill gives way to any waiting request that cannot restore from
        it (another namespace's, or one not extending its prompt); one that can will, so
        it goes on. A cancelled request's prefill stores the grid point it reached. A
        prefetch whose next chunk the budget cannot hold stops before it (headroom.py)."""
        if task.job.background and (self.closing or self.waiting.preempts(task.job)):
            if task.job.orphaned:
                self.prefill.close(task, cancelled=True)
                return
            self.prefetch.cancelled += 1
            self.prefetch.tokens += task.computed
            self.prefill.close(task)
            self.lifecycle.end(task.job, cancelled(task.job))
        elif task.job.background and not task.job.orphaned:
            if not next_chunk_fits(task, self.prefill.store):  # the budget is a cap
                self.prefetch.no_room += 1
                self.prefetch.tokens += task.computed
                self.prefill.close(task)
                self.lifecycle.end(task.job, cancelled(task.job))

    def _prefill_step(self, budget: int, stopping: bool) -> None:
        """Advance the prefilling requests by up to `budget` tokens of grid chunks. A
        cancelled one keeps what it computed: it runs on (`_run_on`), or stops and stores
        the grid point it reached (issue 55)."""
        for task in list(self.prefill.tasks):
            job = task.job
            if job.orphaned and task.position == task.stop_at:
                self.prefill.close(task, cancelled=True)  # stores the state there, live
                continue
            if stopping or (job.handle.cancelled.is_set() and not job.orphaned):
                if not stopping and self._runs_on(task):
                    self._run_on(task)
                    continue
                # A next-turn prefetch stores only what it was for (prefetch.py).
                self.prefill.close(task, cancelled=not job.background or job.orphaned)
                self.lifecycle.end(job, cancelled(job, task.reuse))
        if not self.prefill.tasks:
            return
        self._report_progress()  # where each new prefill starts: its cached tokens
        step = self.prefill.step(budget, decoding=len(self.decode) > 0)
        self.pace.prefilled(step.tokens, step.seconds)
        self._report_progress()
        for task in step.finished:
            self._finish_prefill(task)

    def _report_progress(self) -> None:
        """A ProgressEvent to each prefilling request that asked for one, when its prompt
        moved on since the last (the last says it is whole; its first token follows)."""
        now = time.perf_counter()
        for task in self.prefill.tasks:
            handle = task.job.handle
            # A cancelled prefill running on (`_run_on`) has sent its final event.
            if handle.progress and not task.job.ended and task.position != task.progress_sent:
                task.progress_sent = task.position
                handle.emit(
                    ProgressEvent(
                        total=len(task.tokens),
                        cached=task.reuse,
                        processed=task.position,
                        elapsed_s=now - task.job.submitted_at,
                    )
                )

    def _runs_on(self, task: PrefillTask) -> bool:
        """Whether a cancelled request's prefill goes on for what it stores: with
        --finish-cancelled, not at shutdown, chunks left and a cache to store them in."""
        return (
            self.config.finish_cancelled
            and not self.closing
            and not task.job.background
            and task.checkpointer is not None
            and not task.cursor.done
        )

    def _run_on(self, task: PrefillTask) -> None:
        """End the cancelled request (its client hears it at once) and let its prefill
        run on as a background job: to the prompt's end while nothing waits, giving way
        at its next grid point to a waiting request that cannot restore from it
        (`_preempt_background`), as a next-turn prefetch does; a request that extends
        its prompt (the same prompt sent again) restores from it. What it stores from
        now on is CANCELLED: the first to go (cache/eviction/policy.py)."""
        job = task.job
        self.lifecycle.end(job, cancelled(job, task.reuse))
        job.background = job.orphaned = True
        assert task.checkpointer is not None
        task.checkpointer.cancel()
        # A cache that cannot trim (recurrent layers) is resumed by a resend of the same
        # prompt at its last checkpoint before the end, not at the end (a token must be
        # computed): where the budget cannot hold that state copied beside the live
        # cache, the prefill stops there and stores the live cache itself (cancelled.py).
        last = task.checkpointer.stack_point()
        if task.checkpointer.keep_every_checkpoint and last > task.position:
            if task.checkpointer.no_room(last):
                task.stop_at = last

    def _finish_prefill(self, task: PrefillTask) -> None:
        """The prompt is in the cache: complete a warm-up or a prefetch, or hold the
        request to join the decode batch (`_admit_held`). The task stays listed until
        the request is in the batch, so an error on the way still reaches it."""
        job = task.job
        if job.orphaned:
            # Its end is stored (checkpoints.py), from its cache where it was left to
            # the decode row it will never reach.
            self.prefill.close(task, cancelled=True)
        elif job.background:
            self.prefetch.completed += 1
            self.prefetch.tokens += task.computed
            self.prefill.close(task)
        elif job.warm is not None:
            pinned = self.prefill.pin_checkpoints(job) if job.pin else False
            self.prefill.close(task)
            if not job.warm.done():  # a caller may have cancelled the future itself
                job.warm.set_result(WarmResult(len(job.tokens), task.reuse, pinned))
        else:
            return
        self.lifecycle.finished(job)

    def _admit_held(self) -> None:
        """Requests whose prompt is computed join the decode batch, unless they wait for
        the rest of their burst (engine/requests/pace.py)."""
        held = self.prefill.held()
        if not held or gathers(self.config, len(self.decode), self.prefill.left_to_compute()):
            return
        self.decode.admit([self._arrival(task) for task in held])
        for task in held:
            self.prefill.close(task)

    def _arrival(self, task: PrefillTask) -> Arrival:
        job, limit = task.job, task.job.sampling.max_tokens
        if self.model.context_length is not None:  # the reply is cut at the context's end
            limit = min(limit, self.model.context_length - len(job.tokens))
        assert task.logits is not None
        tps = task.computed / max(time.perf_counter() - task.started_at, 1e-9)
        hand_back = None
        if task.checkpointer is not None and task.checkpointer.end_kind is not None:
            kind = task.checkpointer.end_kind  # stored from the decode row (cache/handover.py)
            states = tuple(task.checkpointer.rows.states)
            hand_back = HandBack(job.cache_key, job.prompt.tokens, kind, states)
        return Arrival(
            job,
            task.cache,
            task.logits,
            limit,
            task.reuse,
            tps,
            task.draft,
            bytes_key=task.bytes_key,
            hand_back=hand_back,
        )
