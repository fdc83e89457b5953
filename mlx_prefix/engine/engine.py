"""The engine: one thread owns the model and every MLX array (DESIGN invariant 1).

Callers (HTTP handlers, the CLI, library users) call `submit`, which renders and
validates the prompt in the caller's thread and queues a job; the engine thread runs
jobs and reports typed events through each request's handle. Cache statistics are
read straight from the thread-safe store.

Each turn of the loop reads as three steps: `_schedule` (take new jobs, drop cancelled
ones, start the next prefill), `_prefill_step` (one grid chunk of the request being
prefilled) and `_decode_step` (one token for every running request). A request's
path: match the longest usable cached prefix -> restore it (shared arrays) -> prefill
the rest chunk by chunk on the grid, capturing checkpoints at planned positions and
at prefixes shared with waiting requests -> join the decode batch -> stream tokens
-> leave the batch.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Generator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.snapshot import cache_nbytes, restore
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.engine.batch import DecodeBatch, batchable
from mlx_prefix.engine.checkpoints import Checkpointer, SharedPrefixes, WaitingPrompt
from mlx_prefix.engine.disk_tier import DiskTier
from mlx_prefix.engine.handle import RequestHandle
from mlx_prefix.engine.prefetch import Prefetcher, wants_prefetch
from mlx_prefix.engine.runner import always_trimmable, prefill_steps
from mlx_prefix.engine.sampling import TokenSampler, normalize
from mlx_prefix.engine.scheduler import extends, pick_next
from mlx_prefix.engine.text import TextStream
from mlx_prefix.errors import ContextLengthExceeded, EngineBusy, InvalidRequest, MlxPrefixError
from mlx_prefix.models.identity import ModelIdentity
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.platform import device_name, loaded_blas
from mlx_prefix.prompt.boundaries import PromptPlanner, RenderedPrompt
from mlx_prefix.prompt.grid import ChunkGrid
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    PromptInput,
    SamplingParams,
    TokenEvent,
    Usage,
)

log = logging.getLogger("mlx_prefix.engine")

ACTIVE_BYTES_EVERY = 64  # decode steps between updates of the batch's resident bytes


@dataclass(frozen=True, slots=True)
class WarmResult:
    prompt_tokens: int
    cached_tokens: int
    pinned: bool


@dataclass(slots=True)
class PrefetchStats:
    """Next-turn prefetch (engine/prefetch.py): background prefills and their tokens."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0  # dropped for a request that could not use them
    tokens: int = 0  # prompt tokens computed in the background


@dataclass(slots=True)
class _Job:
    handle: RequestHandle
    prompt: RenderedPrompt
    sampling: SamplingParams
    cache_pref: CachePreference
    submitted_at: float
    source: PromptInput | None = None  # what the caller sent (None: background job)
    warm: Future | None = None  # set for warm-only jobs (prefill, no decode)
    pin: bool = False
    background: bool = False  # a next-turn prefetch: prefill only, when nothing waits
    not_before: float = 0.0  # monotonic time a background job may start
    passovers: int = 0
    ended: bool = False  # its last event was sent; nothing more may follow


@dataclass(slots=True)
class _Prefill:
    """The one request being prefilled."""

    job: _Job
    cache: list
    reuse: int  # prompt tokens restored from the cache
    position: int  # prompt tokens in `cache` so far
    lease: int | None  # store entry locked while its arrays may still be shared
    steps: Generator[int, None, mx.array]
    started_at: float


@dataclass(slots=True)
class _Running:
    """A request in the decode batch."""

    job: _Job
    stream: TextStream
    limit: int  # completion tokens allowed
    reuse: int
    prefill_tps: float
    first_at: float
    count: int = 0


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        cache_config: CacheConfig | None = None,
        engine_config: EngineConfig | None = None,
        store: PromptCache | None = None,
        disk_config: DiskConfig | None = None,
    ):
        """`disk_config` None or scope "off": no disk tier (memory only)."""
        self.model = model
        self.cache_config = cache_config or CacheConfig()
        self.config = engine_config or EngineConfig()
        self.planner = PromptPlanner(model.tokenizer, self.cache_config)
        self.store = store or PromptCache(
            self.cache_config.budget_bytes, self.cache_config.max_entries
        )
        self.model_key = cache_key(model.identity, self.planner.grid)
        fresh_cache = make_prompt_cache(model.model)
        self.batchable = batchable(fresh_cache)
        self.capacity = self.config.max_running if self.batchable else 1  # decoding at once
        # A server-wide scope of "off" disables the tier: no folder, no files, and no
        # per-request scope can turn it back on.
        self.disk = (
            DiskTier(disk_config, self.model_key, always_trimmable(fresh_cache))
            if disk_config is not None and disk_config.scope != "off" and self.cache_config.enabled
            else None
        )
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting: list[_Job] = []  # engine thread only
        self._prefilling: _Prefill | None = None
        self._batch = DecodeBatch(model.model)
        # Keys of this engine's running caches in the store's byte budget (DESIGN 6); the
        # store may be shared with other engines.
        self._prefill_bytes_key = f"engine-{id(self):x}-prefill"
        self._batch_bytes_key = f"engine-{id(self):x}-batch"
        self._steps = 0
        self.prefetch = PrefetchStats()
        self._prefetcher = (
            Prefetcher(self.planner, self._enqueue_prefetch)
            if self.config.prefetch_next_turn and self.cache_config.enabled
            else None
        )
        self.peak_batch = 0  # most requests ever decoded together (observability, tests)
        self._pending = 0  # submitted and not finished; guarded by _pending_lock
        self._pending_lock = threading.Lock()
        self._accepting = True
        self._closing = False  # the engine thread saw the shutdown marker
        self._stopping = False  # the grace period is over: cancel running requests too
        self._thread = threading.Thread(target=self._loop, name="mlx-prefix-engine", daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------
    def plan(self, prompt: PromptInput) -> RenderedPrompt:
        rendered = self.planner.plan(prompt)
        limit = self.model.context_length
        if limit is not None and len(rendered.tokens) >= limit:
            raise ContextLengthExceeded(
                f"the prompt has {len(rendered.tokens)} tokens; this model's context is "
                f"{limit} tokens, including the reply",
                param="messages" if prompt.messages is not None else "prompt",
            )
        return rendered

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
        for the reply (OpenAI's rule for an explicit max_tokens); otherwise the reply is
        cut at the context's end."""
        if sampling.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if sampling.seed is not None and not 0 <= sampling.seed < 2**64:
            raise InvalidRequest("seed must be between 0 and 2**64 - 1", param="seed")
        DiskTier.parse_scope(cache.scope)
        rendered = self.plan(prompt)
        limit = self.model.context_length
        wanted = len(rendered.tokens) + sampling.max_tokens
        if fit_reply and limit is not None and wanted > limit:
            raise ContextLengthExceeded(
                f"this model's context is {limit} tokens, but {wanted} were requested "
                f"({len(rendered.tokens)} in the prompt, {sampling.max_tokens} for the "
                "completion); shorten the prompt or lower max_tokens",
                param="messages" if prompt.messages is not None else "prompt",
            )
        handle = RequestHandle(request_id or f"req-{uuid.uuid4().hex[:12]}", len(rendered.tokens))
        self._enqueue(_Job(handle, rendered, sampling, cache, time.perf_counter(), prompt))
        return handle

    def warm(
        self, prompt: PromptInput, pin: bool = False, timeout: float | None = None
    ) -> WarmResult:
        """Prefill a prompt into the cache (optionally pinned) without generating. Blocks;
        on `timeout` the warm-up is cancelled and TimeoutError raised."""
        handle, future = self.start_warm(prompt, pin)
        try:
            return future.result(timeout)
        except FutureTimeout:  # the builtin TimeoutError from Python 3.11
            handle.cancel()
            raise

    def start_warm(
        self, prompt: PromptInput, pin: bool = False
    ) -> tuple[RequestHandle, Future[WarmResult]]:
        """Queue a warm-up; its future gives the WarmResult (cancel it with the handle)."""
        rendered = self.plan(prompt)
        future: Future[WarmResult] = Future()
        handle = RequestHandle(f"warm-{uuid.uuid4().hex[:12]}", len(rendered.tokens))
        # A pinned warm-up is meant to last: persist all of its checkpoints to disk too.
        job = _Job(
            handle,
            rendered,
            SamplingParams(max_tokens=1),
            CachePreference(scope="full" if pin else None),
            time.perf_counter(),
            warm=future,
            pin=pin,
        )
        self._enqueue(job)
        return handle, future

    def _enqueue(self, job: _Job) -> None:
        with self._pending_lock:
            if not self._accepting:
                raise EngineBusy("the server is shutting down")
            waiting = self._pending - self.capacity
            if waiting >= self.config.max_queued:
                raise EngineBusy(f"too many requests waiting ({waiting}); try again shortly")
            self._pending += 1
            # Under the lock: once shutdown() stops accepting, no job can land behind the
            # engine's last look at its inbox.
            self._inbox.put(job)

    def _enqueue_prefetch(self, prompt: RenderedPrompt) -> None:
        """Queue a next-turn prefetch (from the prefetcher's thread). Background jobs are
        not counted against `max_queued`: they never keep a request out."""
        handle = RequestHandle(f"prefetch-{uuid.uuid4().hex[:12]}", len(prompt.tokens))
        job = _Job(
            handle,
            prompt,
            SamplingParams(max_tokens=1),
            CachePreference(),
            time.perf_counter(),
            background=True,
            not_before=time.monotonic() + self.config.prefetch_delay_s,
        )
        with self._pending_lock:
            if self._accepting:
                self._inbox.put(job)

    def cache_stats(self) -> dict:
        stats = asdict(self.store.stats())
        lookups = stats["hits"] + stats["misses"]
        stats["hit_ratio"] = stats["hits"] / lookups if lookups else 0.0
        stats["prefetch"] = asdict(self.prefetch)
        if self.disk is not None:
            disk = asdict(self.disk.cache.stats())
            disk["directory"] = str(disk["directory"])
            disk["pending_saves"] = self.disk.pending
            stats["disk"] = disk
        return stats

    def cache_entries(self) -> list[dict]:
        return [asdict(e) for e in self.store.entries()]

    def flush_cache(self) -> int:
        """Drop this model's entries from memory and disk; returns how many."""
        removed = self.store.clear(self.model_key)
        if self.disk is not None:
            removed += self.disk.cache.clear(self.model_key)
        return removed

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting; cancel what waits; let running requests finish until
        `timeout`, then cancel them too; join the engine thread."""
        with self._pending_lock:
            self._accepting = False
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._inbox.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stopping = True
            self._thread.join(5)

    # -- engine thread -------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run_until_closed()
        finally:
            # Normally nothing is left; if the loop itself died, no request may wait forever.
            with self._pending_lock:
                self._accepting = False
            self._take_inbox(block=False)
            self._fail_all(MlxPrefixError("the engine stopped"), waiting_too=True)
            # MLX requires each thread to destroy its own streams before it exits, or
            # the process may abort at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _run_until_closed(self) -> None:
        while True:
            requests_waiting = any(not j.background for j in self._waiting)
            idle = not (requests_waiting or self._prefilling or len(self._batch))
            saving = self.disk is not None and self.disk.pending > 0
            if self._closing and idle and not saving:
                return  # queued saves are written first: a shutdown keeps what disk should
            try:
                if saving:
                    self.disk.write_pending(busy=not idle)  # off the requests' critical path
                block = idle and not self._closing and not saving
                self._take_inbox(block, timeout=self._background_wait() if block else None)
                self._step()
            except Exception as e:  # a bug in one request must not stop the engine
                log.exception("engine step failed")
                self._fail_all(e)

    def _step(self) -> None:
        """Prefill up to `prefill_tokens_per_step` tokens (one request after another,
        each on its own grid), then one decode step for every running request."""
        self._schedule()
        budget = self.config.prefill_tokens_per_step
        while self._prefilling is not None and budget > 0:
            budget -= self._prefill_step()
            # Requests that arrived meanwhile are visible to in-flight sharing at the
            # next chunk boundary, and can start right after this prefill.
            self._take_inbox(block=False)
            self._schedule()
        if len(self._batch):
            self._decode_step()

    def _background_wait(self) -> float | None:
        """Seconds until the next background job may start (None: none waits)."""
        times = [j.not_before for j in self._waiting if j.background]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _take_inbox(self, block: bool, timeout: float | None = None) -> None:
        """Move submitted jobs into the waiting list (waiting up to `timeout` for one
        when `block`); after the shutdown marker, cancel what waits."""
        try:
            job = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            while True:
                if job is None:
                    self._closing = True
                else:
                    self._waiting.append(job)
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass
        if self._closing:
            for job in self._waiting:
                job.handle.cancel()

    def _schedule(self) -> None:
        for job in [j for j in self._waiting if j.handle.cancelled.is_set() or self._stopping]:
            self._waiting.remove(job)
            self._end(job, DoneEvent("cancelled", _usage(job, 0, 0, 0.0, 0.0, 0.0)))
        if self._prefilling is not None:
            self._preempt_background()
            return
        if not self._waiting or len(self._batch) >= self.capacity:
            return
        requests = [j for j in self._waiting if not j.background]
        if requests:
            job = pick_next(requests, self._peek_reuse, self.config.max_passovers)
            # Prefetches this request covers would only recompute what it computes.
            for bg in [j for j in self._waiting if j.background]:
                if extends(job.prompt.tokens, bg.prompt.tokens):
                    self._waiting.remove(bg)
                    self._end(bg, DoneEvent("cancelled", _usage(bg, 0, 0, 0.0, 0.0, 0.0)))
        else:
            job = self._ready_background()
            if job is None:
                return
            self.prefetch.started += 1
        self._waiting.remove(job)
        try:
            self._start_prefill(job)
        except Exception as e:
            log.exception("%s: could not start", job.handle.request_id)
            self._end(job, ErrorEvent(_message(e)))

    def _ready_background(self) -> _Job | None:
        """The oldest background job allowed to start: only on an engine with nothing to
        decode, after its delay (a client that sends its next request at once gets the
        engine to itself)."""
        if len(self._batch):
            return None
        now = time.monotonic()
        return next((j for j in self._waiting if j.background and j.not_before <= now), None)

    def _preempt_background(self) -> None:
        """A background prefill gives way to any waiting request that does not extend its
        prompt; one that does will restore from it, so it goes on."""
        task = self._prefilling
        assert task is not None
        if not task.job.background:
            return
        mine = task.job.prompt.tokens
        if self._closing or any(
            not j.background and not extends(j.prompt.tokens, mine) for j in self._waiting
        ):
            self.prefetch.cancelled += 1
            self.prefetch.tokens += task.position - task.reuse
            self._close_prefill()
            self._end(task.job, DoneEvent("cancelled", _usage(task.job, 0, 0, 0.0, 0.0, 0.0)))

    def _peek_reuse(self, job: _Job) -> int:
        if not (self.cache_config.enabled and job.cache_pref.enabled):
            return 0
        tokens = job.prompt.tokens
        return self.store.match(
            self.model_key, tokens, self._align(tokens), record=False
        ).reuse_tokens

    def _start_prefill(self, job: _Job) -> None:
        tokens = job.prompt.tokens
        use_cache = self.cache_config.enabled and job.cache_pref.enabled
        cache, reuse, lease = None, 0, None
        try:
            if use_cache:
                match = self.store.match(self.model_key, tokens, self._align(tokens))
                if match.entry_id is not None:
                    snapshot = self.store.acquire(match.entry_id)
                    if snapshot is not None:
                        lease = match.entry_id
                        cache, reuse = restore(snapshot, trim=match.trim), match.reuse_tokens
                if self._disk_on(job):
                    found = self.disk.lookup(tokens, self._align(tokens), better_than=reuse)
                    if found is not None:  # a memory miss (or shorter hit) served from disk
                        disk_match, disk_snapshot = found
                        if lease is not None:
                            self.store.release(lease)
                            lease = None
                        cache = restore(disk_snapshot, trim=disk_match.trim)
                        reuse = disk_match.reuse_tokens
                        self.store.insert(
                            self.model_key, disk_match.tokens, disk_snapshot, disk_match.kind
                        )
            if cache is None:
                cache = make_prompt_cache(self.model.model)
            checkpointer = self._checkpointer(job, cache, reuse) if use_cache else None
            steps = prefill_steps(
                self.model.model, cache, tokens, reuse, self.planner.grid, checkpointer or _ignore
            )
        except BaseException:
            if lease is not None:
                self.store.release(lease)
            raise
        self._prefilling = _Prefill(job, cache, reuse, reuse, lease, steps, time.perf_counter())

    def _align(self, tokens):
        return lambda n: self.planner.grid.align(tokens, n)

    def _disk_on(self, job: _Job) -> bool:
        return self.disk is not None and not self.disk.is_off(job.cache_pref.scope)

    def _checkpointer(self, job: _Job, cache: list, reuse: int) -> Checkpointer:
        tokens = job.prompt.tokens
        shared = None
        if not always_trimmable(cache):

            def waiting() -> list[WaitingPrompt]:
                return [
                    WaitingPrompt(id(j), j.prompt.tokens)
                    for j in self._waiting
                    if j.cache_pref.enabled
                ]

            shared = SharedPrefixes(
                tokens, self.planner.grid, waiting, self.config.share_min_tokens
            )
        disk_positions: frozenset[int] = frozenset()
        if self._disk_on(job):
            disk_positions = frozenset(
                self.disk.positions(job.prompt, self._align(tokens), job.cache_pref.scope)
            )
        return Checkpointer(
            job.prompt, cache, reuse, self.store, self.model_key, shared, self.disk, disk_positions
        )

    def _prefill_step(self) -> int:
        """Advance the prefilling request by one grid chunk; returns the tokens computed."""
        task = self._prefilling
        assert task is not None
        job = task.job
        if job.handle.cancelled.is_set() or self._stopping:
            self._close_prefill()
            self._end(job, DoneEvent("cancelled", _usage(job, task.reuse, 0, 0.0, 0.0, 0.0)))
            return 0
        try:
            end = next(task.steps)
        except StopIteration as done:
            self._finish_prefill(task, done.value)
            return 0
        computed, task.position = end - task.position, end
        self.store.set_active_bytes(self._prefill_bytes_key, cache_nbytes(task.cache))
        return computed

    def _finish_prefill(self, task: _Prefill, logits: mx.array) -> None:
        """The prompt is in the cache: sample the first token and join the decode batch
        (or complete a warm-up). The task stays `_prefilling` until the request is in the
        batch, so an error on the way still reaches it (`_fail_all`)."""
        job = task.job
        tokens = job.prompt.tokens
        prefill_tps = (len(tokens) - task.reuse) / max(time.perf_counter() - task.started_at, 1e-9)
        if job.background:
            self.prefetch.completed += 1
            self.prefetch.tokens += len(tokens) - task.reuse
            self._close_prefill()
            job.ended = True
            return
        if job.warm is not None:
            pinned = self._pin_checkpoints(job.prompt) if job.pin else False
            self._close_prefill()
            job.ended = True
            if not job.warm.done():  # a caller may have cancelled the future itself
                job.warm.set_result(WarmResult(len(tokens), task.reuse, pinned))
            self._finished(job)
            return
        sampler = TokenSampler(job.sampling)
        logprobs = normalize(logits)  # [1, V]
        first = sampler(logprobs)  # [1]
        limit = job.sampling.max_tokens
        if self.model.context_length is not None:
            limit = min(limit, self.model.context_length - len(tokens))
        token = int(first.item())
        logprob = logprobs[0, token].item() if job.sampling.logprobs else None
        now = time.perf_counter()
        running = _Running(
            job, TextStream(self.model.tokenizer, job.sampling.stop), limit, task.reuse,
            prefill_tps, now,
        )  # fmt: skip
        if not self._accept_token(running, token, logprob):
            self._batch.add(running, task.cache, sampler, token)
            self.store.set_active_bytes(self._batch_bytes_key, self._batch.nbytes())
        self._close_prefill()

    def _pin_checkpoints(self, prompt: RenderedPrompt) -> bool:
        """Pin the stored entries at this prompt's checkpoints and its end, whether this
        warm-up stored them or an earlier request did. True if any is pinned."""
        positions = {c.position for c in prompt.checkpoints} | {len(prompt.tokens)}
        pinned = False
        for position in sorted(positions):
            key = prompt.tokens[:position]
            if self.store.pin(self.model_key, key):
                pinned = True
            else:
                self.store.unpin(self.model_key, key)  # nothing there: leave no stray pin
        return pinned

    def _close_prefill(self) -> None:
        task = self._prefilling
        assert task is not None
        self._prefilling = None
        task.steps.close()
        self.store.drop_active(self._prefill_bytes_key)
        if task.lease is not None:
            # The request's cache no longer shares the snapshot's arrays once prefill
            # has written into it (and merging into the batch copies them anyway).
            self.store.release(task.lease)

    def _decode_step(self) -> None:
        for running in [
            r for r in self._batch.members if r.job.handle.cancelled.is_set() or self._stopping
        ]:
            self._finish(running, "cancelled")
        if not len(self._batch):
            return
        self.peak_batch = max(self.peak_batch, len(self._batch))
        want_logprobs = any(r.job.sampling.logprobs for r in self._batch.members)
        members = list(self._batch.members)
        sampled = self._batch.step(want_logprobs)
        for running, (token, logprob) in zip(members, sampled, strict=True):
            self._accept_token(running, token, logprob if running.job.sampling.logprobs else None)
        self._steps += 1
        if self._steps % ACTIVE_BYTES_EVERY == 0 and len(self._batch):
            self.store.set_active_bytes(self._batch_bytes_key, self._batch.nbytes())

    def _accept_token(self, running: _Running, token: int, logprob: float | None) -> bool:
        """Hand a sampled token to its request; True if the request ended with it."""
        if token in self.model.tokenizer.eos_token_ids:
            self._finish(running, "stop")
            return True
        running.count += 1
        delta = running.stream.add(token)
        running.job.handle.emit(TokenEvent(delta, token, logprob))
        if running.stream.stopped:
            self._finish(running, "stop")
        elif running.count >= running.limit:
            self._finish(running, "length")
        else:
            return False
        return True

    def _finish(self, running: _Running, reason: str) -> None:
        job = running.job
        tail = running.stream.finish()
        if tail:
            job.handle.emit(TokenEvent(tail, None, None))
        self._batch.remove([running])
        if len(self._batch):
            self.store.set_active_bytes(self._batch_bytes_key, self._batch.nbytes())
        else:
            self.store.drop_active(self._batch_bytes_key)
        decode_s = time.perf_counter() - running.first_at
        decode_tps = (running.count - 1) / decode_s if running.count > 1 and decode_s > 0 else 0.0
        usage = _usage(
            job,
            running.reuse,
            running.count,
            running.first_at - job.submitted_at,
            running.prefill_tps,
            decode_tps,
        )
        self._end(job, DoneEvent(reason, usage))  # type: ignore[arg-type]
        if reason != "cancelled":
            self._maybe_prefetch(job, running.stream.text)

    def _maybe_prefetch(self, job: _Job, reply: str) -> None:
        if self._prefetcher is None or job.source is None or not job.cache_pref.enabled:
            return
        tool_start = getattr(self.model.tokenizer, "tool_call_start", None)
        if wants_prefetch(job.source, reply, tool_start):
            self._prefetcher.submit(job.source, reply, len(job.prompt.tokens))

    def _end(self, job: _Job, event: DoneEvent | ErrorEvent) -> None:
        """Send a job's last event (once: later calls are ignored)."""
        if job.ended:
            return
        job.ended = True
        job.handle.emit(event)
        if job.warm is not None and not job.warm.done():
            job.warm.set_exception(
                EngineBusy("the warm-up was cancelled")
                if isinstance(event, DoneEvent)
                else MlxPrefixError(event.message)
            )
        self._finished(job)

    def _finished(self, job: _Job) -> None:
        if job.background:
            return  # never counted in _pending
        with self._pending_lock:
            self._pending -= 1

    def _fail_all(self, error: Exception, waiting_too: bool = False) -> None:
        """After an unexpected error, end every request in flight with an error event:
        their state may be inconsistent. Waiting requests are unaffected unless
        `waiting_too` (the engine is going away)."""
        event = ErrorEvent(_message(error))
        if self._prefilling is not None:
            job = self._prefilling.job
            self._close_prefill()
            self._end(job, event)
        for running in list(self._batch.members):
            self._end(running.job, event)
        self._batch = DecodeBatch(self.model.model)
        self.store.drop_active(self._batch_bytes_key)
        if waiting_too:
            for job in self._waiting:
                self._end(job, event)
            self._waiting.clear()


def cache_key(identity: ModelIdentity, grid: ChunkGrid) -> str:
    """The key of every cache entry this engine makes. An entry reproduces a cold run
    only for the same weights (identity), the same chunk grid and the same kernels
    (device, BLAS, MLX version), so all of them are in it (DESIGN 4 and 7); a server
    restarted with another --prefill-chunk or BLAS never reads the old files."""
    parts = [identity.key(), grid.signature(), device_name(), loaded_blas(), mx.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _ignore(position: int) -> None:
    pass


def _message(error: BaseException) -> str:
    if isinstance(error, MlxPrefixError):
        return error.message
    return f"{type(error).__name__}: {error}"


def _usage(job: _Job, reuse: int, count: int, ttft: float, prefill_tps: float, decode_tps: float):
    return Usage(
        prompt_tokens=len(job.prompt.tokens),
        completion_tokens=count,
        cached_tokens=reuse,
        ttft_s=ttft,
        prefill_tokens_per_s=prefill_tps,
        decode_tokens_per_s=decode_tps,
    )
