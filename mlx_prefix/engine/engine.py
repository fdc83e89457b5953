"""The engine's request-facing side: one thread owns the model and every MLX array
(invariant 1), and this class is how every other thread reaches it.

An Engine holds its parts, each built whole: the prompt planner, the store and the
disk tier, the cache views callers read (engine/cache_views.py), the engine thread's
loop built from its phases (engine/loop.py, assembled by engine/parts.py), and the turn
driver that runs that loop
(engine/driver.py; a sharded group's is engine/sharded/lockstep.py, passed in by
engine/sharded/distributed.py). Callers call `submit`, which renders and validates the
prompt in the caller's thread and queues a job; the engine thread runs jobs and reports
typed events through each request's handle. Every job ends with exactly one final
event (engine/requests/lifecycle.py). The parts are plain attributes (`loop`, `views`,
`turns`, `lifecycle`, `prefetcher`, ...): the server reads and acts on the cache through
`views` (its statistics, listings, flush, pin and evict); tests read the engine
thread's state through them (`engine.loop.decode.peak_batch`, its speculator's and prompt
lookup's stats), while it is idle.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix import mlx_threads
from mlx_prefix.cache.disk.tier import DiskCache
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import FULL_SCOPE, CacheConfig, DiskConfig, DiskScope, EngineConfig
from mlx_prefix.engine.activity import ActivityBoard
from mlx_prefix.engine.cache_views import CacheViews
from mlx_prefix.engine.calibration import check_draft_config, quantized_kv
from mlx_prefix.engine.decode.batch import batchable
from mlx_prefix.engine.decode.constraints import ConstraintFactory
from mlx_prefix.engine.decode.lookup import PromptLookup
from mlx_prefix.engine.decode.speculative import Speculator, check_lookup_request, check_request
from mlx_prefix.engine.driver import Consensus, LocalTurns, Turns
from mlx_prefix.engine.forward import head as output_head
from mlx_prefix.engine.forward.runner import always_trimmable
from mlx_prefix.engine.keys import cache_key, entry_key
from mlx_prefix.engine.parts import build_loop, disk_access, new_store, sized
from mlx_prefix.engine.requests.admission import (
    check_images,
    check_reply_fits,
    check_sampling,
    plan_prompt,
)
from mlx_prefix.engine.requests.handle import RequestHandle
from mlx_prefix.engine.requests.jobs import Job, PrefetchStats, WarmResult
from mlx_prefix.engine.requests.prefetch import Prefetcher
from mlx_prefix.errors import Unavailable
from mlx_prefix.explain.trace import CacheTrace, ExplainContext
from mlx_prefix.models.cost import estimate_prefill_cost
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.platform import cap_buffer_cache
from mlx_prefix.prompt.reply.reader import ReplyFormat
from mlx_prefix.prompt.request.plan import PromptPlanner, RenderedPrompt
from mlx_prefix.records import CachePreference, PromptInput, SamplingParams

log = logging.getLogger("mlx_prefix.engine")

SHUTDOWN_SAVES_S = 30.0  # after the requests, a shutdown writes queued disk saves this long


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        cache_config: CacheConfig | None = None,
        engine_config: EngineConfig | None = None,
        store: PromptCache | None = None,
        disk_config: DiskConfig | None = None,
        draft: LoadedModel | None = None,
        disk_cache: DiskCache | None = None,
        *,
        turns: Turns | None = None,
        consensus: Consensus | None = None,
    ):
        """`disk_config` None or scope "off": no disk tier (memory only). `draft`: a draft
        model for speculative decoding (engine/decode/speculative.py). `store`, `disk_cache`
        may be shared with other engines (server/served/pool.py). `turns`: the turn driver
        (None: LocalTurns, one process); `consensus`: a sharded group's (driver.Consensus)."""
        check_draft_config(model, draft, engine_config)
        self.model = model
        self.draft = draft
        self.cache_config = sized(cache_config or CacheConfig(), model, store)
        self.config = engine_config or EngineConfig()
        self.turns = turns or LocalTurns(self.config)
        self.lifecycle = self.turns.lifecycle
        self.handle_type = self.turns.handle_type  # what callers hold for each job
        output_head.install(model.model)  # a prompt's logits: its last position's (head.py)
        self.planner = PromptPlanner(
            model.tokenizer, self.cache_config, model.template_args, vision=model.vision
        )
        self.constraints = ConstraintFactory(model.tokenizer)  # response formats (lazy)
        # How the model writes replies, read once: the server's tool choice and reply
        # assembler and the next-turn prefetch all read replies with it.
        self.reply_format = ReplyFormat.of(model.tokenizer)
        self.vocab_size = len(model.tokenizer.get_vocab())  # token ids a request may name
        self.store = store or new_store(self.cache_config)
        cap_buffer_cache(self.store.budget_bytes)  # freed MLX buffers count too
        # Quantized KV (engine/forward/kv_quant.py): in the key, one request at a time.
        self.kv_quant = quantized_kv(model, self.config)
        self.model_key = cache_key(model.identity, self.planner.grid, self.kv_quant)
        self.store.set_prefill_cost(self.model_key, estimate_prefill_cost(model))
        # What the request explainer (explain/) reads of this model: each job's trace holds it.
        self.explain_context = ExplainContext(
            model=model.name,
            identity=model.identity.key(),
            cache_key=self.model_key,
            tokenizer=model.tokenizer,
            grid=self.planner.grid,
            evicted=self.store.evicted,
            renderer=self.planner.renderer,
        )
        fresh_cache = make_prompt_cache(model.model)
        trimmable = always_trimmable(fresh_cache) and self.kv_quant is None
        owner = f"engine-{id(self):x}"  # this engine's bytes in the (maybe shared) store
        self.disk = disk_access(
            disk_config,
            self.cache_config,
            trimmable=trimmable,
            store=self.store,
            owner=owner,
            shared=disk_cache,
            agree=consensus.same if consensus is not None else None,
        )
        speculator = Speculator(draft, self.config.num_draft_tokens) if draft else None
        lookup = None  # a draft model drafts instead; a sharded group's ranks would differ
        if draft is None and consensus is None:
            # Recurrent and sliding-window layers take a rejected draft back too
            # (cache/layers/rewind.py); quantized KV is not shown exact under a verify.
            why = None if self.kv_quant is None else "quantized KV (--kv-bits)"
            lookup = PromptLookup(self.config.prompt_lookup, unusable=why)
        self.prefetch = PrefetchStats()
        board = ActivityBoard(1)
        # The server reads and acts on the cache through this part (`engine.views`);
        # its actions go through the turn driver, which adds its ranks to the stats.
        self.views = CacheViews(
            self.store,
            self.disk,
            self.model_key,
            self.prefetch,
            board,
            speculator,
            act=self.turns.act,
            describe=self.turns.describe,
        )
        self.prefetcher = (
            Prefetcher(self.planner, self.reply_format, self._enqueue_prefetch)
            if self.config.prefetch_next_turn and self.cache_config.enabled and self.turns.leader
            else None
        )
        # Until the engine thread's calibration (the probe, with --deterministic) says more.
        can_batch = batchable(fresh_cache) and self.kv_quant is None
        self.loop = build_loop(
            model=model,
            planner=self.planner,
            store=self.store,
            disk=self.disk,
            cache_config=self.cache_config,
            config=self.config,
            turns=self.turns,
            lifecycle=self.lifecycle,
            kv_quant=self.kv_quant,
            speculator=speculator,
            lookup=lookup,
            board=board,
            prefetch=self.prefetch,
            prefetcher=self.prefetcher,
            can_batch=can_batch,
            owner=owner,
            agree_tokens=consensus.tokens if consensus is not None else None,
        )
        # A reused thread (mlx_threads.py: MLX keeps an OS thread per Python thread).
        self._thread = mlx_threads.start(
            self.turns.run, self.loop, self.views, name="mlx-prefix-engine"
        )

    # -- what the engine is (any thread) ----------------------------------------------
    @property
    def failure(self) -> str | None:
        """Why a sharded group stopped serving for good (None: serving); the server's."""
        return self.turns.failure

    # -- submitting (any thread) ----------------------------------------------------
    def plan(self, prompt: PromptInput) -> RenderedPrompt:
        return plan_prompt(self.planner, self.model.context_length, prompt)

    def count_tokens(self, prompt: PromptInput) -> int:
        """Tokens `prompt` renders to, whether or not it fits the context."""
        return len(self.planner.prompt_tokens(prompt))

    def submit(
        self,
        prompt: PromptInput,
        sampling: SamplingParams,
        cache: CachePreference = CachePreference(),
        request_id: str | None = None,
        *,
        fit_reply: bool = False,
        progress: bool = False,
    ) -> RequestHandle:
        """Render, validate and queue a request. Raises InvalidRequest,
        ContextLengthExceeded, EngineBusy or Unavailable in the caller's thread.

        `fit_reply`: refuse a prompt that leaves less than `max_tokens` of the context
        for the reply; otherwise the reply is cut at the context's end. The request
        reads and writes only the entries of `cache.namespace` (and `cache.salt`).
        `progress`: the handle gets ProgressEvents while the prompt is prefilled."""
        self._check_serving()
        check_sampling(sampling, self.vocab_size)
        check_request(sampling, self.loop.decode.speculator)
        check_lookup_request(sampling, self.loop.decode.lookup is not None)
        rendered = self.plan(prompt)
        check_images(rendered, sampling)
        if fit_reply:
            check_reply_fits(rendered, prompt, sampling.max_tokens, self.model.context_length)
        fmt = sampling.response_format
        constraint = self.constraints.create(fmt) if fmt is not None else None
        key = entry_key(self.model_key, cache)
        handle = self.handle_type(
            request_id or f"req-{uuid.uuid4().hex[:12]}",
            len(rendered.tokens),
            progress=progress,
            opens_reasoning=rendered.opens_reasoning,
            reasoning_edges=rendered.reasoning_edges,
            breakpoint_end=max((c.position for c in rendered.checkpoints if c.marked), default=0),
            trace=CacheTrace.of(  # for the request explainer, filled at admission
                self.explain_context, rendered.tokens, prompt, cache, key, self.cache_config.enabled
            ),
        )
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
        self._check_serving()
        rendered = self.plan(prompt)
        future: Future[WarmResult] = Future()
        handle = self.handle_type(f"warm-{uuid.uuid4().hex[:12]}", len(rendered.tokens))
        # A pinned warm-up is meant to last: persist all of its checkpoints to disk too,
        # unless the caller chose its disk scope.
        scope = cache.scope if cache.scope is not None else FULL_SCOPE if pin else None
        pref = replace(cache, enabled=True, scope=scope)
        key, sampling = entry_key(self.model_key, pref), SamplingParams(max_tokens=1)
        now = time.perf_counter()
        job = Job(handle, rendered, sampling, pref, key, now, warm=future, pin=pin)
        self.lifecycle.put(job)
        return handle, future

    def _enqueue_prefetch(
        self, prompt: RenderedPrompt, key: str, scope: DiskScope | None = None
    ) -> None:
        """Queue a next-turn prefetch under the entry key and disk scope of the request it
        follows (from the prefetcher's thread)."""
        handle = self.handle_type(f"prefetch-{uuid.uuid4().hex[:12]}", len(prompt.tokens))
        not_before = time.monotonic() + self.config.prefetch_delay_s
        pref = CachePreference(scope=scope)
        sampling, now = SamplingParams(max_tokens=1), time.perf_counter()
        job = Job(handle, prompt, sampling, pref, key, now, background=True, not_before=not_before)
        self.lifecycle.put_background(job)

    def _check_serving(self) -> None:
        if self.turns.failure is not None:
            raise Unavailable(self.turns.failure)

    # -- the end ----------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0, save_timeout: float = SHUTDOWN_SAVES_S) -> None:
        """Stop accepting; cancel what waits; let running requests finish until `timeout`,
        then cancel them too; write the queued disk saves for up to `save_timeout` more,
        then drop the rest with a log line each (invariant 11); join the engine thread."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.lifecycle.close()
        if self.turns.failure is not None:
            self._thread.join(1.0)  # a sharded group's thread may sit in a dead collective
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.turns.stop()
            self._thread.join(save_timeout)
        if self._thread.is_alive():
            self.turns.abandon_saves()
            self._thread.join(5)  # the file being written, if any
        if self._thread.is_alive():
            pending = self.disk.pending if self.disk is not None else 0
            log.warning("the engine thread is still busy; %d queued disk save(s) lost", pending)

    def release(self) -> None:
        """After `shutdown`, for an unload: what the engine thread kept of its model
        (the vision-feature cache) goes; the weights are the unloader's
        (server/served/loading.py)."""
        self.loop.prefill.release()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the engine thread to end; True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
