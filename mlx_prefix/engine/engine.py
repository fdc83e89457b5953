"""The engine: one thread owns the model and every MLX array (DESIGN invariant 1).

Callers (HTTP handlers, the CLI, library users) call `submit`, which renders and
validates the prompt in the caller's thread and queues a job; the engine thread runs
jobs and reports typed events through each request's handle. Cache statistics are
read straight from the thread-safe store.

One request's path: match the longest usable cached prefix -> restore it (shared
arrays) -> prefill the rest chunk by chunk on the grid, capturing checkpoints at the
planned positions -> decode, streaming text deltas -> release the snapshot lease and
the request's active bytes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.snapshot import cache_nbytes, capture, restore
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.handle import RequestHandle
from mlx_prefix.engine.request import (
    CachePreference,
    DoneEvent,
    ErrorEvent,
    PromptInput,
    SamplingParams,
    TokenEvent,
    Usage,
)
from mlx_prefix.engine.runner import always_trimmable, decode, prefill
from mlx_prefix.engine.text import TextStream
from mlx_prefix.errors import ContextLengthExceeded, EngineBusy, InvalidRequest, MlxPrefixError
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.prompt.boundaries import PromptPlanner, RenderedPrompt, common_prefix_length

log = logging.getLogger("mlx_prefix.engine")

ACTIVE_BYTES_EVERY = 64  # decode steps between updates of the request's resident bytes


@dataclass(frozen=True, slots=True)
class WarmResult:
    prompt_tokens: int
    cached_tokens: int
    pinned: bool


@dataclass(slots=True)
class _Job:
    handle: RequestHandle
    prompt: RenderedPrompt
    sampling: SamplingParams
    cache_pref: CachePreference
    submitted_at: float
    warm: Future | None = None  # set for warm-only jobs (prefill, no decode)
    pin: bool = False
    checkpoints_stored: list[int] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        cache_config: CacheConfig | None = None,
        engine_config: EngineConfig | None = None,
        store: PromptCache | None = None,
    ):
        self.model = model
        self.cache_config = cache_config or CacheConfig()
        self.config = engine_config or EngineConfig()
        self.planner = PromptPlanner(model.tokenizer, self.cache_config)
        self.store = store or PromptCache(
            self.cache_config.budget_bytes, self.cache_config.max_entries
        )
        self.model_key = model.identity.key()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._accepting = True
        self._ids = itertools.count(1)
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
    ) -> RequestHandle:
        """Render, validate and queue a request. Raises InvalidRequest,
        ContextLengthExceeded or EngineBusy in the caller's thread."""
        if sampling.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        rendered = self.plan(prompt)
        handle = RequestHandle(request_id or f"req-{uuid.uuid4().hex[:12]}", len(rendered.tokens))
        self._enqueue(_Job(handle, rendered, sampling, cache, time.perf_counter()))
        return handle

    def warm(self, prompt: PromptInput, pin: bool = False, timeout: float | None = None) -> WarmResult:
        """Prefill a prompt into the cache (optionally pinned) without generating. Blocks."""
        rendered = self.plan(prompt)
        future: Future[WarmResult] = Future()
        handle = RequestHandle(f"warm-{next(self._ids)}", len(rendered.tokens))
        job = _Job(handle, rendered, SamplingParams(max_tokens=1), CachePreference(),
                   time.perf_counter(), warm=future, pin=pin)
        self._enqueue(job)
        return future.result(timeout)

    def _enqueue(self, job: _Job) -> None:
        with self._pending_lock:
            if not self._accepting:
                raise EngineBusy("the server is shutting down")
            if self._pending >= self.config.max_queued:
                raise EngineBusy(
                    f"too many requests waiting ({self._pending}); try again shortly"
                )
            self._pending += 1
        self._jobs.put(job)

    def cache_stats(self) -> dict:
        from dataclasses import asdict

        stats = asdict(self.store.stats())
        lookups = stats.get("hits", 0) + stats.get("misses", 0)
        stats["hit_ratio"] = stats.get("hits", 0) / lookups if lookups else 0.0
        return stats

    def cache_entries(self) -> list[dict]:
        from dataclasses import asdict

        return [asdict(e) for e in self.store.entries()]

    def flush_cache(self) -> int:
        return self.store.clear(self.model_key)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting; cancel what waits; let the running request end; join."""
        with self._pending_lock:
            self._accepting = False
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- engine thread -------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._drain_cancelled()
                return
            try:
                if not self._accepting and job.warm is None:
                    job.handle.cancel()  # shutting down: queued requests end at once
                self._run(job)
            except Exception as e:  # one bad request must not stop the engine
                log.exception("request %s failed", job.handle.request_id)
                message = e.message if isinstance(e, MlxPrefixError) else f"{type(e).__name__}: {e}"
                job.handle.emit(ErrorEvent(message))
                if job.warm is not None and not job.warm.done():
                    job.warm.set_exception(e)
            finally:
                with self._pending_lock:
                    self._pending -= 1

    def _drain_cancelled(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            job.handle.emit(DoneEvent("cancelled", _usage(job, 0, 0, 0.0, 0.0, 0.0)))
            if job.warm is not None:
                job.warm.set_exception(EngineBusy("the server is shutting down"))

    def _run(self, job: _Job) -> None:
        tokens = job.prompt.tokens
        handle = job.handle
        if handle.cancelled.is_set() and job.warm is None:
            handle.emit(DoneEvent("cancelled", _usage(job, 0, 0, 0.0, 0.0, 0.0)))
            return
        use_cache = self.cache_config.enabled and job.cache_pref.enabled
        lease = None
        cache = None
        reuse = 0
        if use_cache:
            match = self.store.match(
                self.model_key, tokens, lambda n: self.planner.grid.align(tokens, n)
            )
            snapshot = self.store.acquire(match.entry_id) if match.entry_id is not None else None
            if snapshot is not None:
                lease = match.entry_id
                cache = restore(snapshot, trim=match.trim)
                reuse = match.reuse_tokens
        if cache is None:
            cache = make_prompt_cache(self.model.model)
        try:
            self._prefill_and_decode(job, cache, reuse, use_cache)
        finally:
            if lease is not None:
                self.store.release(lease)
            self.store.drop_active(handle.request_id)

    def _prefill_and_decode(self, job: _Job, cache: list, reuse: int, use_cache: bool) -> None:
        tokens, handle = job.prompt.tokens, job.handle
        planned = {cp.position: cp.kind for cp in job.prompt.checkpoints if cp.position > reuse}
        keep_every_checkpoint = not always_trimmable(cache)

        shared = _SharedPrefixes(self, job) if use_cache and keep_every_checkpoint else None

        def on_boundary(position: int) -> None:
            if not use_cache:
                return
            if shared is not None:
                for p in shared.positions():
                    if p >= position:
                        planned[p] = max(planned.get(p, CheckpointKind.LAST_MESSAGE),
                                         CheckpointKind.LAST_MESSAGE)
            kind = planned.get(position)
            at_end = position == len(tokens)
            if at_end and kind is None:
                kind = CheckpointKind.HISTORY
            if kind is None or (not keep_every_checkpoint and not at_end):
                return
            snapshot = capture(cache, position)
            if not at_end or snapshot.trimmable or position in planned:
                if self.store.insert(self.model_key, tokens[:position], snapshot, kind):
                    job.checkpoints_stored.append(position)

        started = time.perf_counter()
        logits = prefill(self.model.model, cache, tokens, reuse, self.planner.grid, on_boundary,
                         handle.cancelled.is_set)
        prefill_s = time.perf_counter() - started
        computed = len(tokens) - reuse
        self.store.set_active_bytes(handle.request_id, cache_nbytes(cache))
        if job.warm is not None:
            if job.pin:
                for position in job.checkpoints_stored:
                    self.store.pin(self.model_key, tokens[:position])
            job.warm.set_result(WarmResult(len(tokens), reuse, job.pin))
            return
        if logits is None:
            handle.emit(DoneEvent("cancelled", _usage(job, reuse, 0, 0.0, 0.0, 0.0)))
            return
        self._decode(job, cache, logits, reuse, computed / max(prefill_s, 1e-9))

    def _decode(self, job: _Job, cache: list, logits: mx.array, reuse: int, prefill_tps: float):
        handle, sampling = job.handle, job.sampling
        limit = sampling.max_tokens
        if self.model.context_length is not None:
            limit = min(limit, self.model.context_length - len(job.prompt.tokens))
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        stream = TextStream(self.model.tokenizer, sampling.stop)
        eos = self.model.tokenizer.eos_token_ids
        finish = "length"
        count = 0
        first_at = decode_start = time.perf_counter()
        for sampled in decode(self.model.model, cache, logits, sampling):
            if count == 0:
                first_at = decode_start = time.perf_counter()
            if sampled.token in eos:
                finish = "stop"
                break
            count += 1
            delta = stream.add(sampled.token)
            handle.emit(TokenEvent(delta, sampled.token, sampled.logprob))
            if stream.stopped:
                finish = "stop"
                break
            if handle.cancelled.is_set():
                finish = "cancelled"
                break
            if count >= limit:
                break
            if count % ACTIVE_BYTES_EVERY == 0:
                self.store.set_active_bytes(handle.request_id, cache_nbytes(cache))
        tail = stream.finish()
        if tail:
            handle.emit(TokenEvent(tail, None, None))
        decode_s = time.perf_counter() - decode_start
        decode_tps = (count - 1) / decode_s if count > 1 and decode_s > 0 else 0.0
        ttft = first_at - job.submitted_at
        handle.emit(DoneEvent(finish, _usage(job, reuse, count, ttft, prefill_tps, decode_tps)))


class _SharedPrefixes:
    """In-flight sharing for caches that can only resume from exact checkpoints.

    While a request prefills, requests waiting in the queue that share a long prefix
    with it get a checkpoint at that prefix's end (aligned down to the grid), so they
    restore from it instead of computing it again. Trimmable caches need none of this:
    their end-of-prompt snapshot already serves every shared prefix.
    """

    def __init__(self, engine: Engine, job: _Job):
        self.engine = engine
        self.tokens = job.prompt.tokens
        self.job = job
        self.seen: dict[int, int] = {}  # id(waiting job) -> aligned shared position (0: none)

    def positions(self) -> set[int]:
        engine, tokens = self.engine, self.tokens
        with engine._jobs.mutex:
            waiting = [j for j in engine._jobs.queue if j is not None and j is not self.job]
        for other in waiting:
            if id(other) in self.seen or not other.cache_pref.enabled:
                continue
            shared = common_prefix_length(tokens, other.prompt.tokens)
            limit = min(shared, len(tokens) - 1, len(other.prompt.tokens) - 1)
            aligned = engine.planner.grid.align(tokens, limit)
            self.seen[id(other)] = aligned if aligned >= engine.config.share_min_tokens else 0
        return {p for p in self.seen.values() if p}


def _usage(job: _Job, reuse: int, count: int, ttft: float, prefill_tps: float, decode_tps: float):
    return Usage(
        prompt_tokens=len(job.prompt.tokens),
        completion_tokens=count,
        cached_tokens=reuse,
        ttft_s=ttft,
        prefill_tokens_per_s=prefill_tps,
        decode_tokens_per_s=decode_tps,
    )
