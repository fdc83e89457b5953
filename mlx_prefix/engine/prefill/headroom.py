"""Whether a next-turn prefetch's next chunk fits the budget (issue 55: the budget is a
cap on what the cache and running requests hold; a speculative prefill gives way rather
than take it past). Engine thread only."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from mlx_prefix.cache.handover import hybrid, kv_bytes, kv_growth
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.engine.prefill.task import PrefillTask


def next_chunk_fits(task: PrefillTask, store: PromptCache) -> bool:
    """Whether `task`'s next chunk fits beside what eviction cannot free (its own bytes
    among them): what its KV buffers may grow by (`kv_growth`, the estimate a checkpoint's
    room uses too) and what a checkpoint at the chunk's end may capture (a piece of the new
    positions; a hybrid's other layers). A cold cache's first chunk is not foreseen (its
    KV has no size yet). Does not mutate."""
    if task.cursor.done:
        return True
    start, end = task.cursor.next_chunk()
    grows = kv_growth(task.cache, end - start)
    captured = kv_bytes(task.cache, end - start)
    if hybrid(task.cache):
        captured += sum(c.nbytes for c in task.cache if type(c) is not KVCache)
    return store.could_hold(grows + captured)
