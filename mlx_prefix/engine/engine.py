"""The engine: one thread owns the model and every MLX array (DESIGN invariant 1).

Callers (HTTP handlers, the CLI, library users) call `submit`, which renders and
validates the prompt in the caller's thread and queues a job; the engine thread runs
jobs and reports typed events through each request's handle. Cache statistics are
read straight from the thread-safe store.

Each turn of the loop reads as three steps: `_schedule` (take new jobs, drop cancelled
ones, start the next prefill), the prefill phase (grid chunks of the request being
prefilled, engine/prefill.py) and the decode phase (one token for every running
request, engine/decode.py). A request's path: match the longest usable cached prefix
-> restore it (shared arrays) -> prefill the rest chunk by chunk on the grid,
capturing checkpoints at planned positions and at prefixes shared with waiting
requests -> join the decode batch -> stream tokens -> leave the batch. Every job ends
with exactly one final event (engine/lifecycle.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.disk import DiskCache
from mlx_prefix.cache.eviction import policy_named
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.engine import rowwise
from mlx_prefix.engine.activity import ActivityBoard
from mlx_prefix.engine.admission import check_reply_fits, check_sampling, plan_prompt
from mlx_prefix.engine.batch import batchable
from mlx_prefix.engine.cache_views import CacheViews
from mlx_prefix.engine.chat_traffic import ChatTraffic
from mlx_prefix.engine.constraints import ConstraintFactory
from mlx_prefix.engine.decode import DecodePhase
from mlx_prefix.engine.disk_tier import DiskTier
from mlx_prefix.engine.handle import RequestHandle
from mlx_prefix.engine.jobs import Job, PrefetchStats, PrefillTask, WarmResult, cancelled
from mlx_prefix.engine.keys import cache_key, entry_key
from mlx_prefix.engine.kv_quant import KvQuant, check_model
from mlx_prefix.engine.lifecycle import Lifecycle, error_message
from mlx_prefix.engine.pace import Pace, gathers
from mlx_prefix.engine.prefetch import Prefetcher, wants_prefetch
from mlx_prefix.engine.prefill import PrefillPhase
from mlx_prefix.engine.probe import probe
from mlx_prefix.engine.runner import always_trimmable
from mlx_prefix.engine.scheduler import WaitingList
from mlx_prefix.engine.speculative import (
    DraftMismatch,
    SpeculationStats,
    Speculator,
    check_draft,
    check_request,
    verify_matches,
)
from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.models.cost import estimate_prefill_cost
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.prompt.boundaries import PromptPlanner, RenderedPrompt
from mlx_prefix.prompt.tool_calls import ToolSyntax
from mlx_prefix.records import (
    CachePreference,
    ErrorEvent,
    PromptInput,
    SamplingParams,
)

log = logging.getLogger("mlx_prefix.engine")

SHUTDOWN_SAVES_S = 30.0  # after the requests, a shutdown writes queued disk saves this long

__all__ = ["Engine", "PrefetchStats", "WarmResult", "cache_key"]


class Engine(CacheViews):
    handle_type: type[RequestHandle] = RequestHandle  # what callers hold for each job

    def __init__(
        self,
        model: LoadedModel,
        cache_config: CacheConfig | None = None,
        engine_config: EngineConfig | None = None,
        store: PromptCache | None = None,
        disk_config: DiskConfig | None = None,
        draft: LoadedModel | None = None,
        disk_cache: DiskCache | None = None,
    ):
        """`disk_config` None or scope "off": no disk tier (memory only). `draft`: a
        draft model for speculative decoding (engine/speculative.py). `store` and
        `disk_cache` may be shared with other engines (server/model_pool.py)."""
        if draft is not None:
            check_draft(model, draft)
            if engine_config is not None and engine_config.kv_bits is not None:
                # Not shown exact yet: the verify forward over quantized keys.
                raise DraftMismatch("--draft-model cannot be combined with --kv-bits yet")
        self.model = model
        self.draft = draft
        self.cache_config = cache_config or CacheConfig()
        self.config = engine_config or EngineConfig()
        self.planner = PromptPlanner(model.tokenizer, self.cache_config, model.template_args)
        self.constraints = ConstraintFactory(model.tokenizer)  # response formats (lazy)
        self.vocab_size = len(model.tokenizer.get_vocab())  # token ids a request may name
        self.store = store or PromptCache(
            self.cache_config.budget_bytes,
            self.cache_config.max_entries,
            policy=policy_named(self.cache_config.eviction),
        )
        c = self.config  # quantized KV (engine/kv_quant.py): in the key, one request at a time
        self.kv_quant = KvQuant.of(c.kv_bits, c.kv_group_size, c.quantized_kv_start)
        if self.kv_quant is not None:
            check_model(model.model, self.kv_quant)
        self.model_key = cache_key(model.identity, self.planner.grid, self.kv_quant)
        self.store.set_prefill_cost(self.model_key, estimate_prefill_cost(model))
        fresh_cache = make_prompt_cache(model.model)
        # Until the engine thread's probe says more.
        self.batchable = batchable(fresh_cache) and self.kv_quant is None
        self.capacity = 1  # requests decoding at once: set by `_calibrate`
        # A server-wide scope of "off" disables the tier: no folder, no files, and no
        # per-request scope can turn it back on.
        self.disk = (
            DiskTier(
                disk_config,
                always_trimmable(fresh_cache) and self.kv_quant is None,
                self.store,
                bytes_key=f"engine-{id(self):x}-disk",
                cache=disk_cache,
            )
            if disk_config is not None and disk_config.scope != "off" and self.cache_config.enabled
            else None
        )
        self.lifecycle = Lifecycle(lambda: self.capacity, self.config.max_queued)
        self._board = ActivityBoard(self.capacity)
        self._waiting: WaitingList[Job] = WaitingList()  # engine thread only
        # Keys of this engine's running caches in the store's byte budget (DESIGN 6); the
        # store may be shared with other engines.
        self._prefill = PrefillPhase(
            model,
            self.planner,
            self.store,
            self.disk,
            self.cache_config,
            self.config,
            lambda: self._waiting,
            bytes_key=f"engine-{id(self):x}-prefill",
        )
        self._prefill.kv_quant = self.kv_quant
        self._decode = DecodePhase(
            model,
            1,
            self.store,
            f"engine-{id(self):x}-batch",
            self.lifecycle.end,
            self._maybe_prefetch,
            kv=self.kv_quant,
        )
        if draft is not None:
            speculator = Speculator(draft, self.config.num_draft_tokens)
            self._decode.speculator = self._prefill.speculator = speculator
        self._pace = Pace(self.config)
        self.prefetch = PrefetchStats()
        self._chat_traffic = ChatTraffic()  # engine thread only
        self._prefetcher = (
            Prefetcher(self.planner, ToolSyntax.of(model.tokenizer), self._enqueue_prefetch)
            if self.config.prefetch_next_turn and self.cache_config.enabled
            else None
        )
        self._closing = False  # the engine thread saw the shutdown marker
        self._stopping = False  # the grace period is over: cancel running requests too
        self._abandon_saves = False  # shutdown's time for queued disk saves is over
        self._thread = threading.Thread(target=self._loop, name="mlx-prefix-engine", daemon=True)
        self._thread.start()

    @property
    def peak_batch(self) -> int:
        """Most requests ever decoded together (observability, tests)."""
        return self._decode.peak_batch

    @property
    def speculation(self) -> SpeculationStats | None:
        """Draft tokens proposed and accepted (None: no draft model)."""
        spec = self._decode.speculator
        return spec.stats if spec is not None else None

    @property
    def _pending(self) -> int:
        return self.lifecycle.pending

    @property
    def _steps(self) -> int:
        return self._decode.steps

    # -- caller side ---------------------------------------------------------------
    def plan(self, prompt: PromptInput) -> RenderedPrompt:
        return plan_prompt(self.planner, self.model.context_length, prompt)

    def count_tokens(self, prompt: PromptInput) -> int:
        """Tokens `prompt` renders to, whether or not it fits the context."""
        return len(self.planner.renderer.prompt_tokens(prompt))

    def submit(
        self,
        prompt: PromptInput,
        sampling: SamplingParams,
        cache: CachePreference = CachePreference(),
        request_id: str | None = None,
        *,
        fit_reply: bool = False,
    ) -> RequestHandle:
        """Render, validate and queue a request. Raises InvalidRequest,
        ContextLengthExceeded or EngineBusy in the caller's thread.

        `fit_reply`: refuse a prompt that leaves less than `max_tokens` of the context
        for the reply; otherwise the reply is cut at the context's end. The request
        reads and writes only the entries of `cache.namespace` (and `cache.salt`)."""
        check_sampling(sampling, cache, self.vocab_size)
        check_request(sampling, self._decode.speculator)
        rendered = self.plan(prompt)
        if fit_reply:
            check_reply_fits(rendered, prompt, sampling.max_tokens, self.model.context_length)
        fmt = sampling.response_format
        constraint = self.constraints.create(fmt) if fmt is not None else None
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
        handle = self.handle_type(request_id, len(rendered.tokens))
        key = entry_key(self.model_key, cache)
        now = time.perf_counter()
        self.lifecycle.put(
            Job(handle, rendered, sampling, cache, key, now, prompt, constraint=constraint)
        )
        return handle

    def warm(
        self,
        prompt: PromptInput,
        pin: bool = False,
        timeout: float | None = None,
        cache: CachePreference = CachePreference(),
    ) -> WarmResult:
        """Prefill a prompt into the cache (optionally pinned) without generating. Blocks;
        on `timeout` the warm-up is cancelled and TimeoutError raised."""
        handle, future = self.start_warm(prompt, pin, cache)
        try:
            return future.result(timeout)
        except FutureTimeout:  # the builtin TimeoutError from Python 3.11
            handle.cancel()
            raise

    def start_warm(
        self, prompt: PromptInput, pin: bool = False, cache: CachePreference = CachePreference()
    ) -> tuple[RequestHandle, Future[WarmResult]]:
        """Queue a warm-up into `cache.namespace` (and `cache.salt`); its future gives the
        WarmResult (cancel it with the handle)."""
        rendered = self.plan(prompt)
        future: Future[WarmResult] = Future()
        handle = self.handle_type(f"warm-{uuid.uuid4().hex[:12]}", len(rendered.tokens))
        # A pinned warm-up is meant to last: persist all of its checkpoints to disk too.
        pref = replace(cache, enabled=True, scope="full" if pin else None)
        key, sampling = entry_key(self.model_key, pref), SamplingParams(max_tokens=1)
        now = time.perf_counter()
        job = Job(handle, rendered, sampling, pref, key, now, warm=future, pin=pin)
        self.lifecycle.put(job)
        return handle, future

    def _enqueue_prefetch(self, prompt: RenderedPrompt, key: str) -> None:
        """Queue a next-turn prefetch under the entry key of the request it follows
        (from the prefetcher's thread)."""
        handle = self.handle_type(f"prefetch-{uuid.uuid4().hex[:12]}", len(prompt.tokens))
        not_before = time.monotonic() + self.config.prefetch_delay_s
        sampling, pref, now = SamplingParams(max_tokens=1), CachePreference(), time.perf_counter()
        job = Job(handle, prompt, sampling, pref, key, now, background=True, not_before=not_before)
        self.lifecycle.put_background(job)

    def shutdown(self, timeout: float = 10.0, save_timeout: float = SHUTDOWN_SAVES_S) -> None:
        """Stop accepting; cancel what waits; let running requests finish until `timeout`,
        then cancel them too; write the queued disk saves for up to `save_timeout` more,
        then drop the rest with a log line each (DESIGN 11); join the engine thread."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        self.lifecycle.close()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stopping = True
            self._thread.join(save_timeout)
        if self._thread.is_alive():
            self._abandon_saves = True
            self._thread.join(5)  # the file being written, if any
        if self._thread.is_alive():
            pending = self.disk.pending if self.disk is not None else 0
            log.warning("the engine thread is still busy; %d queued disk save(s) lost", pending)

    # -- engine thread -------------------------------------------------------------
    def _calibrate(self) -> None:
        """Make batched forwards batch-invariant (engine/rowwise.py) and check it on this
        model and backend (engine/probe.py); what does not hold runs alone. Requests
        submitted meanwhile wait in the inbox."""
        model = self.model.model
        rowwise.install(model)
        rows = rowwise.consistent_rows(model)
        checked = probe(model, rows, self.model.tokenizer.vocab_size)
        self.batchable = self.batchable and checked.batched_decode
        self._prefill.group = checked.stacked_prefill
        self._decode.set_rows(rows)
        self.capacity = self.config.max_running if self.batchable else 1
        spec = self._decode.speculator
        if spec is not None and not verify_matches(model, rows, self.model.tokenizer.vocab_size):
            log.warning("a verify forward changes this model's numbers here: decoding plainly")
            spec.enabled = False  # the replies are the same, only not sped up

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
        while True:
            idle = not (self._waiting.has_requests() or self._prefill.tasks or len(self._decode))
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
                self._take_inbox(block, timeout=self._waiting.background_wait() if block else None)
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
            self._prefill_step(self._pace.prefill_budget(len(self._decode)))
            # Requests that arrived meanwhile are visible to in-flight sharing at the
            # next chunk boundary, and can start right after.
            self._take_inbox(block=False)
            self._schedule()
        self._admit_held()
        if len(self._decode):
            started = time.perf_counter()
            self._decode.step(self._stopping)
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
        step = self._prefill.step(budget)
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
        the rest of their burst (engine/pace.py)."""
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
        first_turn = self._chat_traffic.finished(job.source, reply, job.cache_key)
        if first_turn or wants_prefetch(job.source):
            self._prefetcher.submit(
                job.source, reply, len(job.tokens), job.handle.request_id, job.cache_key
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
