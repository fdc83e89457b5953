"""The engine's request-facing side: one thread owns the model and every MLX array
(invariant 1), and this class is how every other thread reaches it.

Callers (HTTP handlers, the CLI, library users) call `submit`, which renders and
validates the prompt in the caller's thread and queues a job; the engine thread
(engine/loop.py) runs jobs and reports typed events through each request's handle.
Cache statistics are read straight from the thread-safe store (engine/cache_views.py).

A request's path: match the longest usable cached prefix -> restore it (shared arrays)
-> prefill the rest chunk by chunk on the grid, capturing checkpoints at planned
positions and at prefixes shared with waiting requests -> join the decode batch ->
stream tokens -> leave the batch. Every job ends with exactly one final event
(engine/requests/lifecycle.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.disk import DiskCache
from mlx_prefix.cache.eviction import policy_named
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.engine.activity import ActivityBoard
from mlx_prefix.engine.cache_views import CacheViews
from mlx_prefix.engine.calibration import check_draft_config, quantized_kv
from mlx_prefix.engine.decode.batch import batchable
from mlx_prefix.engine.decode.constraints import ConstraintFactory
from mlx_prefix.engine.decode.phase import DecodePhase
from mlx_prefix.engine.decode.speculative import SpeculationStats, Speculator, check_request
from mlx_prefix.engine.forward import head as output_head
from mlx_prefix.engine.forward.runner import always_trimmable
from mlx_prefix.engine.keys import cache_key, entry_key
from mlx_prefix.engine.loop import EngineLoop
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.prefill.phase import PrefillPhase
from mlx_prefix.engine.requests.admission import (
    check_images,
    check_reply_fits,
    check_sampling,
    plan_prompt,
)
from mlx_prefix.engine.requests.chat_traffic import ChatTraffic
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.engine.requests.jobs import Job, PrefetchStats, WarmResult
from mlx_prefix.engine.requests.lifecycle import Lifecycle
from mlx_prefix.engine.requests.pace import Pace
from mlx_prefix.engine.requests.prefetch import Prefetcher
from mlx_prefix.engine.requests.scheduler import WaitingList
from mlx_prefix.models.cost import estimate_prefill_cost
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.platform import cap_buffer_cache
from mlx_prefix.prompt.boundaries import PromptPlanner, RenderedPrompt
from mlx_prefix.prompt.harmony import Harmony
from mlx_prefix.prompt.reply import tool_syntax
from mlx_prefix.records import CachePreference, PromptInput, SamplingParams

log = logging.getLogger("mlx_prefix.engine")

SHUTDOWN_SAVES_S = 30.0  # after the requests, a shutdown writes queued disk saves this long

__all__ = ["Engine", "PrefetchStats", "WarmResult", "cache_key"]


class Engine(CacheViews, EngineLoop):
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
        draft model for speculative decoding (engine/decode/speculative.py). `store` and
        `disk_cache` may be shared with other engines (server/model_pool.py)."""
        check_draft_config(model, draft, engine_config)
        self.model = model
        output_head.install(model.model)  # a prompt's logits: its last position's (head.py)
        self.draft = draft
        self.cache_config = cache_config or CacheConfig()
        self.config = engine_config or EngineConfig()
        self.planner = PromptPlanner(
            model.tokenizer, self.cache_config, model.template_args, vision=model.vision
        )
        self.constraints = ConstraintFactory(model.tokenizer)  # response formats (lazy)
        self.vocab_size = len(model.tokenizer.get_vocab())  # token ids a request may name
        self.store = store or PromptCache(
            self.cache_config.budget_bytes,
            self.cache_config.max_entries,
            policy=policy_named(self.cache_config.eviction),
            pin_share=self.cache_config.pin_share,
        )
        cap_buffer_cache(self.store.budget_bytes)  # freed MLX buffers count too
        # Quantized KV (engine/forward/kv_quant.py): in the key, one request at a time.
        self.kv_quant = quantized_kv(model, self.config)
        self.model_key = cache_key(model.identity, self.planner.grid, self.kv_quant)
        self.store.set_prefill_cost(self.model_key, estimate_prefill_cost(model))
        fresh_cache = make_prompt_cache(model.model)
        # Until the engine thread's calibration (the probe, with --deterministic) says more.
        self.batchable = batchable(fresh_cache) and self.kv_quant is None
        self.capacity = 1  # requests decoding at once: set by `_calibrate`
        # A server-wide scope of "off" disables the tier: no folder, no files, and no
        # per-request scope can turn it back on.
        self.disk = (
            DiskAccess(
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
        # Keys of this engine's running caches in the store's byte budget (invariant 6); the
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
            None,
            self.store,
            f"engine-{id(self):x}-batch",
            self.lifecycle.end,
            self._maybe_prefetch,
            kv=self.kv_quant,
        )
        self._decode.reasoning = self.planner.reasoning  # reasoning budgets' markers
        if (harmony := Harmony.of(model.tokenizer)) is not None:
            # gpt-oss's <|return|> and <|call|> end a reply: its generation_config.json
            # lists them, a folder converted without that file does not.
            tokenizer = model.tokenizer
            tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | set(harmony.stops)
        if draft is not None:
            speculator = Speculator(draft, self.config.num_draft_tokens)
            self._decode.speculator = self._prefill.speculator = speculator
        self._pace = Pace(self.config)
        self.prefetch = PrefetchStats()
        self._chat_traffic = ChatTraffic()  # engine thread only
        self._prefetcher = (
            Prefetcher(self.planner, tool_syntax(model.tokenizer), self._enqueue_prefetch)
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
        check_images(rendered, sampling)
        if fit_reply:
            check_reply_fits(rendered, prompt, sampling.max_tokens, self.model.context_length)
        fmt = sampling.response_format
        constraint = self.constraints.create(fmt) if fmt is not None else None
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
        handle = self.handle_type(request_id, len(rendered.tokens))
        handle.opens_reasoning = rendered.opens_reasoning
        handle.reasoning_edges = rendered.reasoning_edges
        handle.breakpoint_end = max(
            (c.position for c in rendered.checkpoints if c.marked), default=0
        )
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
        # A pinned warm-up is meant to last: persist all of its checkpoints to disk too,
        # unless the caller chose its disk scope.
        scope = cache.scope if cache.scope is not None else "full" if pin else None
        pref = replace(cache, enabled=True, scope=scope)
        key, sampling = entry_key(self.model_key, pref), SamplingParams(max_tokens=1)
        now = time.perf_counter()
        job = Job(handle, rendered, sampling, pref, key, now, warm=future, pin=pin)
        self.lifecycle.put(job)
        return handle, future

    def _enqueue_prefetch(self, prompt: RenderedPrompt, key: str, scope: str | None = None) -> None:
        """Queue a next-turn prefetch under the entry key and disk scope of the request it
        follows (from the prefetcher's thread)."""
        handle = self.handle_type(f"prefetch-{uuid.uuid4().hex[:12]}", len(prompt.tokens))
        not_before = time.monotonic() + self.config.prefetch_delay_s
        pref = CachePreference(scope=scope)
        sampling, now = SamplingParams(max_tokens=1), time.perf_counter()
        job = Job(handle, prompt, sampling, pref, key, now, background=True, not_before=not_before)
        self.lifecycle.put_background(job)

    def shutdown(self, timeout: float = 10.0, save_timeout: float = SHUTDOWN_SAVES_S) -> None:
        """Stop accepting; cancel what waits; let running requests finish until `timeout`,
        then cancel them too; write the queued disk saves for up to `save_timeout` more,
        then drop the rest with a log line each (invariant 11); join the engine thread."""
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
