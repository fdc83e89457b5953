"""The prefill phase: the requests being prefilled, from their cache match to their logits.

Start (start.py): restore the longest usable cached prefix (restore.py) and plan the
checkpoints this prefill leaves behind (a Checkpointer per request, at its own offsets:
invariant 5).
Step: the rests of ready requests that stack in one batch (tails.py), or else the next
grid chunk of several requests, exactly the chunks a cold run of each computes
(engine/forward/runner.py). Each prefilling request's cache counts against the store's
byte budget (invariant 6). Engine thread only.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_prefix.cache.layers import layers_of
from mlx_prefix.cache.layers.base import unstash
from mlx_prefix.cache.snapshot import cache_nbytes
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.types import Buffer
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.decode.speculative import Speculator
from mlx_prefix.engine.forward.kv_quant import KvQuant
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.engine.prefill.cancelled import keep_stopped
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.prefill.rounds import choose_chunks, in_order
from mlx_prefix.engine.prefill.start import begin
from mlx_prefix.engine.prefill.tails import (
    TailGroup,
    compute_group,
    may_stack,
    padding_allowance,
    tail_group,
    waits_to_stack,
)
from mlx_prefix.engine.prefill.task import PrefillTask
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.errors import PinQuotaExceeded
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.vision.family import PreparedImage
from mlx_prefix.vision.features import FeatureCache
from mlx_prefix.vision.forward import VisionChunks

# The vision-feature cache holds at most this share of the cache's byte budget.
FEATURE_SHARE = 16


@dataclass(slots=True)
class PrefillStep:
    """What one prefill step did."""

    tokens: int = 0  # prompt tokens computed
    seconds: float = 0.0
    finished: list[PrefillTask] = field(default_factory=list)  # their `logits` set


class PrefillPhase:
    def __init__(
        self,
        model: LoadedModel,
        planner: PromptPlanner,
        store: PromptCache,
        disk: DiskAccess | None,
        cache_config: CacheConfig,
        config: EngineConfig,
        waiting: Iterable[Job],
        bytes_key: str,
        *,
        kv_quant: KvQuant | None = None,
        speculator: Speculator | None = None,
    ):
        self.model = model
        self.planner = planner
        self.store = store
        self.disk = disk
        self.cache_config = cache_config
        self.config = config
        self._waiting = waiting  # the jobs waiting to start (in-flight sharing looks at them)
        self._bytes_key = bytes_key  # this engine's prefill bytes in the store's budget
        self._serial = itertools.count()
        self.tasks: list[PrefillTask] = []  # oldest first
        # Stack equal-shape chunks in one forward: only batch-invariant (--deterministic)
        # engines whose probe agreed (engine/calibration.py); otherwise each runs alone.
        self.group = False
        self.peak_tasks = 0  # most requests ever prefilling at once (observability, tests)
        self.stacked = 0  # chunks computed in a stacked forward with others
        self.tails_stacked = 0  # prompt rests computed stacked (tails.py), never stored
        # Padded tokens a stacked group may compute per token of its rests (tails.py).
        self.stack_padding = padding_allowance(mx.default_device())
        self.kv_quant = kv_quant  # quantize KV after each chunk (engine/forward/kv_quant.py)
        # With --draft-model: the draft follows each prefill, restored and checkpointed
        # beside the target's cache (engine/decode/speculative.py).
        self.speculator = speculator
        # A vision model's tower outputs by image key (vision/features.py), their bytes
        # in the store's budget beside the prefills'.
        self.features: FeatureCache | None = None
        if model.vision is not None:
            share = max(cache_config.budget_bytes // FEATURE_SHARE, 1)
            self.features = FeatureCache(model.vision, share)

    def release(self) -> None:
        """The engine is unloaded: the tower outputs go, and so do their bytes in the
        (shared) store's budget, which would otherwise count them for good."""
        if self.features is not None:
            self.features.clear()
            self.store.drop_active(f"{self._bytes_key}/vision")

    def uses_cache(self, job: Job) -> bool:
        return self.cache_config.enabled and job.cache_pref.enabled

    def peek_reuse(self, job: Job) -> int:
        """Tokens `job` would restore from memory now. Does not lock or count a hit."""
        if not self.uses_cache(job):
            return 0
        tokens = job.prompt.tokens
        match = self.store.match(job.cache_key, tokens, self.align(tokens), record=False)
        return match.reuse_tokens

    def align(self, tokens) -> Callable[[int], int]:
        return lambda n: self.planner.grid.align(tokens, n)

    def disk_on(self, job: Job) -> bool:
        return self.disk is not None and not self.disk.is_off(job.cache_pref.scope)

    def waits_for_sharing(self, job: Job) -> bool:
        """Whether `job` should wait for a prefilling request to store a prefix they share
        (in-flight sharing): computing it twice side by side would waste the work."""
        if not self.uses_cache(job):
            return False
        tokens = job.prompt.tokens
        for task in self.tasks:
            if not self.uses_cache(task.job):
                continue
            other = task.job.prompt.tokens
            limit = min(common_prefix_length(tokens, other), len(tokens) - 1, len(other) - 1)
            shared = self.planner.grid.align(tokens, limit)
            if shared >= self.config.share_min_tokens and shared > self.peek_reuse(job):
                return True
        return False

    @property
    def computing(self) -> int:
        """Tasks with chunks left to compute (the others hold their logits), those whose
        rest may stack aside: they leave together in one forward (tails.py)."""
        return sum(1 for t in self.tasks if not t.cursor.done and not self._may_stack(t))

    @property
    def stack_limit(self) -> int:
        """The longest rest a task may stack (0: none; never in batch-invariant mode)."""
        return 0 if self.group or self.config.deterministic else self.config.stack_tail_tokens

    def _may_stack(self, task: PrefillTask) -> bool:
        return may_stack(task, self.stack_limit, self._waiting, self.config.share_min_tokens)

    def left_to_compute(self) -> int:
        """Prompt tokens the tasks still computing have left, background prefetches
        aside (they give way to requests; nobody waits for them)."""
        return sum(
            len(t.tokens) - t.position
            for t in self.tasks
            if not t.cursor.done and not t.job.background
        )

    def held(self) -> list[PrefillTask]:
        """Requests whose prompt is computed, waiting to join the decode batch (oldest
        first)."""
        return [t for t in self.tasks if t.logits is not None]

    def start(self, job: Job) -> bool:
        """Restore the longest usable cached prefix of `job`'s own entry key (its namespace:
        invariant 10) and add `job` to the prefilling tasks (start.py); False: not added."""
        task = begin(
            job,
            model=self.model,
            planner=self.planner,
            store=self.store,
            disk=self.disk,
            use_cache=self.uses_cache(job),
            disk_on=self.disk_on(job),
            waiting=self._waiting,
            share_min_tokens=self.config.share_min_tokens,
            kv_quant=self.kv_quant,
            speculator=self.speculator,
            bytes_key=lambda: f"task{next(self._serial)}/{self._bytes_key}",
        )
        if task is None:
            return False
        if task.checkpointer is not None:
            task.checkpointer.report = lambda: self._report(task)
        self.tasks.append(task)
        self.peak_tasks = max(self.peak_tasks, len(self.tasks))
        return True

    def step(self, budget: int, decoding: bool = False) -> PrefillStep:
        """Compute the rests of ready requests that stack (tails.py) in one batch, or else
        the next grid chunk of each task in turn (`_in_order`), up to `budget` tokens (at
        least one chunk), then more rounds while the budget lasts. Tasks whose
        prompt is now all in the cache come back with their logits; they stay in `tasks`
        until `close`, so an error on the way still reaches them."""
        result = PrefillStep()
        started = time.perf_counter()
        while not result.finished and result.tokens < budget:
            # Rests that reached their stack points, in this step or before, stack now.
            if self.stack_limit and self._stack(result, budget, decoding):
                break
            limit, ready = self.stack_limit, self._may_stack
            alone = [
                t
                for t in self._in_order()
                if t.position != t.stop_at and not waits_to_stack(t, self.tasks, limit, ready=ready)
            ]
            chosen, tokens = choose_chunks(alone, budget, result.tokens)
            if not chosen:
                break
            works = [self._work(t) for t in chosen]
            outputs = compute_chunks(self.model.model, works, self.group)
            if self.group:
                shapes = Counter((w.start, w.end - w.start) for w in works)
                self.stacked += sum(n for n in shapes.values() if n > 1)
            result.tokens += tokens
            for task, logits in zip(chosen, outputs, strict=True):
                end = task.cursor.advance()
                self._quantize(task)
                if task.draft is not None and self.speculator is not None:
                    # at `end` before the checkpoint captures it
                    self.speculator.prefill_to(task.draft, task.tokens, end)
                if task.checkpointer is not None:
                    task.checkpointer(end)
                    if logits is not None:
                        task.checkpointer.finish()  # before decode writes into the cache
                self._report(task)
                if logits is not None:
                    task.logits = logits
                    result.finished.append(task)
            if result.finished:
                break  # those join the decode batch now
        result.seconds = time.perf_counter() - started
        return result

    def _stack(self, result: PrefillStep, budget: int, decoding: bool) -> bool:
        """Compute the largest group of ready rests in one forward, if one forms (True)."""
        ready = [t for t in self._in_order() if self._may_stack(t)]
        # Nothing decoding waits on a stacked group: then it takes every ready rest.
        room = budget - result.tokens if decoding else sys.maxsize
        group = tail_group(ready, self.stack_limit, room, self.stack_padding)
        if group is None:
            return False
        self._stacked_step(group, result)
        return True

    def _stacked_step(self, group: TailGroup, result: PrefillStep) -> None:
        """The group's rests in one forward; nothing of them is stored (tails.py)."""
        outputs = compute_group(self.model.model, group)
        result.tokens += group.tokens
        self.tails_stacked += len(group.tasks)
        for task, logits in zip(group.tasks, outputs, strict=True):
            task.cursor.finish()
            if task.checkpointer is not None:
                task.checkpointer.finish()
            self._report(task)
            task.logits = logits
            result.finished.append(task)

    def _in_order(self) -> list[PrefillTask]:
        return in_order(self.tasks, self.group)  # rounds.py

    def _work(self, task: PrefillTask) -> ChunkWork:
        start, end = task.cursor.next_chunk()
        return ChunkWork(task.cache, task.tokens, start, end, vision=self._vision(task))

    def _vision(self, task: PrefillTask) -> VisionChunks | None:
        """How `task`'s chunks take its images (None: a prompt without images)."""
        vision = task.job.prompt.vision
        if vision is None:
            return None
        assert self.features is not None
        return VisionChunks(vision, self._features)

    def _features(self, image: PreparedImage) -> mx.array:
        assert self.features is not None
        features = self.features(image)
        self.store.set_active_bytes(f"{self._bytes_key}/vision", self.features.nbytes)
        return features

    def _report(self, task: PrefillTask) -> None:
        """The task's active bytes: its cache, its draft's, the pieces and checkpoints its
        prefill holds (`Checkpointer.held`); those stored entries hold too count once."""
        nbytes = cache_nbytes(task.cache)
        held: tuple[Buffer, ...] = ()
        if task.draft is not None:
            nbytes += task.draft.nbytes()
        if task.checkpointer is not None:
            held = task.checkpointer.held()
            nbytes += sum(b.nbytes for b in held)
        self.store.set_active_bytes(task.bytes_key, nbytes, held)

    def _quantize(self, task: PrefillTask) -> None:
        """mlx_lm's check after a forward: KV layers past --quantized-kv-start quantize.
        Checkpoints still waiting for the float KV are completed from it first."""
        if self.kv_quant is None or not self.kv_quant.due(task.cache):
            return
        if task.checkpointer is not None:
            task.checkpointer.settle()
        self.kv_quant.apply(task.cache)

    def close(
        self, task: PrefillTask, *, failed: bool = False, cancelled: bool = False
    ) -> PrefillTask:
        """End a task (done, `cancelled` or `failed`); returns it. A cancelled prefill
        stores the checkpoints it reached and its state where it stopped (issue 55); a
        failed one (its cache may be broken) only those already stored."""
        self.tasks.remove(task)
        if not failed:  # where it stopped, or what a decode row was left (cancelled.py)
            keep_stopped(task, cancelled=cancelled, grid=self.planner.grid, store=self.store)
        for layer in layers_of(task.cache):
            unstash(layer)  # its restored parts: the entry's pieces, no longer needed
        if task.checkpointer is not None:
            task.checkpointer.finish(keep=not failed)
            # Its report callback holds the task: a cycle that kept the whole cache
            # alive, outside the budget, until Python's rare full collection.
            task.checkpointer.report = lambda: None
        self.store.drop_active(task.bytes_key)
        if task.lease is not None:
            # The request's cache no longer shares the snapshot's arrays once prefill
            # has written into it (and merging into the batch copies them anyway).
            self.store.release(task.lease)
        return task

    def pin_checkpoints(self, job: Job) -> bool:
        """Pin the stored entries at this prompt's checkpoints and its end, whether this
        warm-up stored them or an earlier request did. True if any is pinned."""
        prompt = job.prompt
        positions = {c.position for c in prompt.checkpoints} | {len(prompt.tokens)}
        try:
            return self.store.pin_stored(job.cache_key, [prompt.tokens[:p] for p in positions]) > 0
        except PinQuotaExceeded as e:  # over the namespace's share: the warm-up's answer
            if job.warm is not None and not job.warm.done():
                job.warm.set_exception(e)
            return False
