"""The engine thread: the Engine's side that owns the model and every MLX array
(invariant 1); callers only reach it through the inbox (engine/requests/lifecycle.py).

It calibrates first (engine/calibration.py; only `--deterministic` measures), then
each turn of the loop reads as three steps: `_schedule` (take new jobs, drop cancelled
ones, start the next prefill), the prefill phase (grid chunks of the requests being
prefilled, engine/prefill/phase.py) and the decode phase (one token for every running
request, engine/decode/phase.py). Every job ends with exactly one final event
(engine/requests/lifecycle.py); an error inside a step ends the requests in flight
(`_fail_all`) and the engine goes on.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.activity import ActivityBoard
from mlx_prefix.engine.calibration import PLAIN, Calibration, calibrate, check_speculator
from mlx_prefix.engine.decode.phase import DecodePhase
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.prefill.phase import PrefillPhase
from mlx_prefix.engine.requests.chat_traffic import ChatTraffic
from mlx_prefix.engine.requests.jobs import Job, PrefetchStats, PrefillTask, WarmResult, cancelled
from mlx_prefix.engine.requests.lifecycle import Lifecycle, error_message
from mlx_prefix.engine.requests.pace import Pace, gathers
from mlx_prefix.engine.requests.prefetch import Prefetcher, wants_prefetch
from mlx_prefix.engine.requests.scheduler import WaitingList
from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.platform import trim_heap
from mlx_prefix.prompt.reply import answer_text
from mlx_prefix.records import ErrorEvent

log = logging.getLogger("mlx_prefix.engine")


class EngineLoop:
    """The Engine (engine/engine.py) inherits this and builds its state; these methods
    run on the engine thread only."""

    model: LoadedModel
    config: EngineConfig
    disk: DiskAccess | None
    lifecycle: Lifecycle
    batchable: bool
    capacity: int
    prefetch: PrefetchStats
    _board: ActivityBoard
    _waiting: WaitingList[Job]
    _prefill: PrefillPhase
    _decode: DecodePhase
    _pace: Pace
    _chat_traffic: ChatTraffic
    _prefetcher: Prefetcher | None
    _closing: bool
    _stopping: bool
    _abandon_saves: bool

    def _calibrate(self) -> None:
        """With --deterministic, make batched forwards batch-invariant and check them on
        this model and backend (engine/calibration.py; what does not hold runs alone);
        requests submitted meanwhile wait in the inbox. Otherwise nothing is measured."""
        found = calibrate(self.model) if self.config.deterministic else PLAIN
        self._calibrated(found)
        check_speculator(self.model, found.rows, self._decode.speculator)

    def _calibrated(self, found: Calibration) -> None:
        self.batchable = self.batchable and found.batched_decode
        self._prefill.group = found.stacked_prefill
        self._decode.set_rows(found.rows)
        self.capacity = self.config.max_running if self.batchable else 1

    def _loop(self) -> None:
        try:
            self._calibrate()
            self._run_until_closed()
        finally:
            # Normally nothing is left; if the loop itself died, no request may wait forever.
            self.lifecycle.stop_accepting()
            self._take_inbox(block=False)
            self._fail_all(MlxPrefixError("the engine stopped"), waiting_too=True)
            if self.disk is not None:
                self.disk.drop_pending("the engine stopped")
            # MLX requires each thread to destroy its own streams before it exits, or
            # the process may abort at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _run_until_closed(self) -> None:
        worked = False  # since the heap was last trimmed
        while True:
            idle = not (self._waiting.has_requests() or self._prefill.tasks or len(self._decode))
            worked = worked or not idle
            saving = self.disk is not None and self.disk.pending > 0
            if saving and self._abandon_saves:
                self.disk.drop_pending("the shutdown's time for disk saves ran out")
                saving = False
            if self._closing and idle and not saving:
                return  # queued saves are written first: a shutdown keeps what disk should
            try:
                if saving:
                    # Off the requests' critical path: never between two tokens.
                    self.disk.write_pending(busy=not idle, decoding=len(self._decode) > 0)
                block = idle and not self._closing and not saving
                wait = self._waiting.background_wait() if block else None
                trim_s = self.config.idle_trim_s
                # Idle after work: wait a moment first (never between two requests of a
                # burst), unless a background prefill is due sooner.
                trim = block and worked and trim_s is not None and (wait is None or wait >= trim_s)
                self._take_inbox(block, timeout=trim_s if trim else wait)
                if trim and not self._waiting.has_requests():
                    trim_heap()  # once per idle transition, off every request's path
                    worked = False
                self._step()
            except Exception as e:  # a bug in one request must not stop the engine
                log.exception("engine step failed")
                self._fail_all(e)
            self._board.publish(
                self._waiting, self._prefill.tasks, self._decode.running(), self.capacity
            )

    def _step(self) -> None:
        """Prefill: the next grid chunks of the prefilling requests (each on its own grid,
        equal-shape chunks stacked), as many tokens as fit between two decode steps; then
        one decode step for every running request."""
        self._schedule()
        if self._prefill.tasks:
            self._decode.read_launched()  # the prefill's time is its own (pace.py)
            self._prefill_step(self._pace.prefill_budget(len(self._decode)))
            # Requests that arrived meanwhile are visible to in-flight sharing at the
            # next chunk boundary, and can start right after.
            self._take_inbox(block=False)
            self._schedule()
        self._admit_held()
        if len(self._decode):
            # While prompts prefill between decode steps, a step is computed and read
            # whole: the pace weighs its time against theirs. Otherwise the next step
            # launches before this one is read (DecodeBatch.step), as mlx_lm pipelines.
            started = time.perf_counter()
            self._decode.step(self._stopping, overlap=not self._prefill.tasks)
            self._pace.decoded(time.perf_counter() - started)

    def _take_inbox(self, block: bool, timeout: float | None = None) -> None:
        """Move submitted jobs into the waiting list (waiting up to `timeout` for one
        when `block`); after the shutdown marker, cancel what waits."""
        jobs, closing = self.lifecycle.take(block, timeout)
        self._waiting.add(jobs)
        self._closing = self._closing or closing
        if self._closing:
            for job in self._waiting:
                job.handle.cancel()

    def _schedule(self) -> None:
        gone = self._waiting.take_if(lambda j: j.handle.cancelled.is_set() or self._stopping)
        for job in gone:
            self.lifecycle.end(job, cancelled(job))
        for task in list(self._prefill.tasks):
            self._preempt_background(task)
        while len(self._waiting) and self._room():
            startable = lambda j: not self._prefill.waits_for_sharing(j)  # noqa: E731
            job = self._waiting.next_request(
                self._prefill.peek_reuse, self.config.max_passovers, startable
            )
            if job is not None:
                for bg in self._waiting.superseded_by(job):
                    self.lifecycle.end(bg, cancelled(bg))
            else:
                busy = len(self._decode) > 0 or bool(self._prefill.tasks)
                job = self._waiting.ready_background(decoding=busy)
                if job is None:
                    return
                self.prefetch.started += 1
            try:
                self._prefill.start(job)
            except Exception as e:
                log.exception("%s: could not start", job.handle.request_id)
                self.lifecycle.end(job, ErrorEvent(error_message(e)))

    def _room(self) -> bool:
        """Whether another request may start prefilling: it will join the decode batch."""
        busy = len(self._decode) + len(self._prefill.tasks)
        return busy < self.capacity and self._prefill.computing < self.config.max_prefilling

    def _preempt_background(self, task: PrefillTask) -> None:
        """A background prefill gives way to any waiting request that cannot restore from
        it (another namespace's, or one not extending its prompt); one that can will, so
        it goes on."""
        if task.job.background and (self._closing or self._waiting.preempts(task.job)):
            self.prefetch.cancelled += 1
            self.prefetch.tokens += task.computed
            self._prefill.close(task)
            self.lifecycle.end(task.job, cancelled(task.job))

    def _prefill_step(self, budget: int) -> None:
        """Advance the prefilling requests by up to `budget` tokens of grid chunks."""
        for task in list(self._prefill.tasks):
            if task.job.handle.cancelled.is_set() or self._stopping:
                self._prefill.close(task)
                self.lifecycle.end(task.job, cancelled(task.job, task.reuse))
        if not self._prefill.tasks:
            return
        step = self._prefill.step(budget, decoding=len(self._decode) > 0)
        self._pace.prefilled(step.tokens, step.seconds)
        for task, logits in step.finished:
            self._finish_prefill(task, logits)

    def _finish_prefill(self, task: PrefillTask, logits: mx.array) -> None:
        """The prompt is in the cache: join the decode batch, or complete a warm-up or
        a prefetch. The task stays listed until the request is in the batch, so an
        error on the way still reaches it (`_fail_all`)."""
        job = task.job
        if job.background:
            self.prefetch.completed += 1
            self.prefetch.tokens += task.computed
            self._prefill.close(task)
        elif job.warm is not None:
            pinned = self._prefill.pin_checkpoints(job) if job.pin else False
            self._prefill.close(task)
            if not job.warm.done():  # a caller may have cancelled the future itself
                job.warm.set_result(WarmResult(len(job.tokens), task.reuse, pinned))
        else:
            task.logits = logits  # joins the decode batch in `_admit_held`
            return
        self.lifecycle.finished(job)

    def _admit_held(self) -> None:
        """Requests whose prompt is computed join the decode batch, unless they wait for
        the rest of their burst (engine/requests/pace.py)."""
        held = self._prefill.held()
        if not held or gathers(self.config, len(self._decode), self._prefill.left_to_compute()):
            return
        arrivals = []
        for task in held:
            job, limit = task.job, task.job.sampling.max_tokens
            if self.model.context_length is not None:  # the reply is cut at the context's end
                limit = min(limit, self.model.context_length - len(job.tokens))
            arrivals.append((task, task.logits, limit))
        self._decode.admit(arrivals)
        for task in held:
            self._prefill.close(task)

    def _maybe_prefetch(self, job: Job, reply: str) -> None:
        if self._prefetcher is None or job.source is None or not job.cache_pref.enabled:
            return
        # A chat's first turn, known from its client's earlier traffic in the same
        # namespace (chat_traffic.py); later turns and tool-call turns from the request.
        # The reply as its client sees it and sends it back: without its reasoning.
        shown = answer_text(self.model.tokenizer, reply, job.prompt.opens_reasoning)
        first_turn = self._chat_traffic.finished(job.source, shown, job.cache_key)
        if first_turn or wants_prefetch(job.source):
            self._prefetcher.submit(
                job.source,
                reply,
                len(job.tokens),
                job.handle.request_id,
                job.cache_key,
                job.cache_pref.scope,  # its disk scope: "off" writes nothing, prefetch too
                job.prompt.opens_reasoning,
            )

    def _fail_all(self, error: Exception, waiting_too: bool = False) -> None:
        """After an unexpected error, end every request in flight with an error event:
        their state may be inconsistent. Waiting requests are unaffected unless
        `waiting_too` (the engine is going away)."""
        event = ErrorEvent(error_message(error))
        for task in list(self._prefill.tasks):
            self.lifecycle.end(self._prefill.close(task, failed=True).job, event)
        for job in self._decode.drop_all():
            self.lifecycle.end(job, event)
        if waiting_too:
            for job in self._waiting.take_if(lambda j: True):
                self.lifecycle.end(job, event)
