"""The prefill phase: the request being prefilled, from its cache match to its logits.

Start: match the longest usable cached prefix in memory (or on disk when that gives
more), restore it (shared arrays, the entry locked while they may be shared), and plan
the checkpoints this prefill leaves behind. Step: one grid chunk at a time, exactly the
chunks a cold run computes. The prefilling request's cache counts against the store's
byte budget (DESIGN 6). Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.snapshot import cache_nbytes, restore
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.checkpoints import Checkpointer, SharedPrefixes, WaitingPrompt
from mlx_prefix.engine.disk_tier import DiskTier
from mlx_prefix.engine.jobs import Job, PrefillTask
from mlx_prefix.engine.runner import always_trimmable, prefill_steps
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.prompt.boundaries import PromptPlanner


class PrefillPhase:
    def __init__(
        self,
        model: LoadedModel,
        planner: PromptPlanner,
        store: PromptCache,
        disk: DiskTier | None,
        cache_config: CacheConfig,
        config: EngineConfig,
        waiting: Callable[[], Iterable[Job]],
        bytes_key: str,
    ):
        self.model = model
        self.planner = planner
        self.store = store
        self.disk = disk
        self.cache_config = cache_config
        self.config = config
        self._waiting = waiting  # the jobs waiting to start (in-flight sharing looks at them)
        self._bytes_key = bytes_key  # this engine's prefill bytes in the store's budget
        self.task: PrefillTask | None = None

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

    def start(self, job: Job) -> None:
        """Restore the longest usable cached prefix of `job`'s own entry key (its
        namespace: DESIGN 10) and make `job` the prefilling task."""
        assert self.task is None, "one prefill at a time"
        tokens, key = job.prompt.tokens, job.cache_key
        use_cache = self.uses_cache(job)
        cache, reuse, lease = None, 0, None
        try:
            if use_cache:
                match = self.store.match(key, tokens, self.align(tokens))
                if match.entry_id is not None:
                    snapshot = self.store.acquire(match.entry_id)
                    if snapshot is not None:
                        lease = match.entry_id
                        cache, reuse = restore(snapshot, trim=match.trim), match.reuse_tokens
                if self.disk_on(job):
                    found = self.disk.lookup(key, tokens, self.align(tokens), better_than=reuse)
                    if found is not None:  # a memory miss (or shorter hit) served from disk
                        disk_match, disk_snapshot = found
                        if lease is not None:
                            self.store.release(lease)
                            lease = None
                        cache = restore(disk_snapshot, trim=disk_match.trim)
                        reuse = disk_match.reuse_tokens
                        self.store.insert(key, disk_match.tokens, disk_snapshot, disk_match.kind)
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
        self.task = PrefillTask(job, cache, reuse, reuse, lease, steps, time.perf_counter())

    def step(self) -> mx.array | int:
        """Compute the task's next grid chunk. Returns the tokens computed, or the last
        position's logits [1, V] once the whole prompt is in the cache (the task stays
        current until `close`, so an error on the way still reaches it)."""
        task = self.task
        assert task is not None
        try:
            end = next(task.steps)
        except StopIteration as done:
            return done.value
        computed, task.position = end - task.position, end
        self.store.set_active_bytes(self._bytes_key, cache_nbytes(task.cache))
        return computed

    def close(self) -> PrefillTask:
        """End the current task (done, cancelled or failed); returns it."""
        task = self.task
        assert task is not None
        self.task = None
        task.steps.close()
        self.store.drop_active(self._bytes_key)
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
        pinned = False
        for position in sorted(positions):
            key = prompt.tokens[:position]
            if self.store.pin(job.cache_key, key):
                pinned = True
            else:
                self.store.unpin(job.cache_key, key)  # nothing there: leave no stray pin
        return pinned

    def _checkpointer(self, job: Job, cache: list, reuse: int) -> Checkpointer:
        tokens = job.prompt.tokens
        shared = None
        if not always_trimmable(cache):

            def waiting() -> list[WaitingPrompt]:
                # Only requests of the same key may restore what this prefill stores: a
                # checkpoint made for another namespace would be a hit it can time.
                return [
                    WaitingPrompt(id(j), j.prompt.tokens)
                    for j in self._waiting()
                    if j.cache_pref.enabled and j.cache_key == job.cache_key
                ]

            shared = SharedPrefixes(
                tokens, self.planner.grid, waiting, self.config.share_min_tokens
            )
        disk_positions: frozenset[int] = frozenset()
        if self.disk_on(job):
            disk_positions = frozenset(
                self.disk.positions(
                    job.cache_key, job.prompt, self.align(tokens), job.cache_pref.scope
                )
            )
        return Checkpointer(
            job.prompt, cache, reuse, self.store, job.cache_key, shared, self.disk, disk_positions
        )


def _ignore(position: int) -> None:
    pass
