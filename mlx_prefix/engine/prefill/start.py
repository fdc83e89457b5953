"""A request's prefill begun: the longest usable cached prefix of its own entry key
restored (restore.py; its namespace: invariant 10), the draft's cache beside it
(--draft-model), and the plan of what this prefill stores: a Checkpointer at the
request's own offsets (invariant 5), SharedPrefixes where the cache cannot be trimmed
(in-flight sharing), the positions that go to disk. The prefill phase (phase.py) calls
`begin` with its parts and keeps the task. Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.handover import plain_kv_cache
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.engine.decode.speculative import Speculator
from mlx_prefix.engine.forward.kv_quant import KvQuant
from mlx_prefix.engine.forward.runner import PrefillCursor, always_trimmable
from mlx_prefix.engine.prefill.checkpoints import Checkpointer
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.prefill.restore import Restored, restore_longest
from mlx_prefix.engine.prefill.sharing import SharedPrefixes, WaitingPrompt
from mlx_prefix.engine.prefill.task import PrefillTask
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.prompt.request.plan import PromptPlanner


def begin(
    job: Job,
    *,
    model: LoadedModel,
    planner: PromptPlanner,
    store: PromptCache,
    disk: DiskAccess | None,
    use_cache: bool,
    disk_on: bool,
    waiting: Iterable[Job],
    share_min_tokens: int,
    kv_quant: KvQuant | None,
    speculator: Speculator | None,
    bytes_key: Callable[[], str],
) -> PrefillTask | None:
    """`job`'s prefill task: its cache restored (or new), its draft and its checkpoint
    plan. The entry it restored from stays locked (the task's `lease`) unless this
    raises. `bytes_key()` names the task's bytes in the store's budget. None: a
    next-turn prefetch the budget has no room for (restore.py `speculative`)."""
    tokens = job.prompt.tokens
    found = Restored()
    # A tight budget may hand the entry to this request (cache/handover.py); its decode
    # row gives the longer entry back, or, for a next-turn prefetch (which ends with its
    # prefill), its cache where it ends or gives way (cancelled.py `keep_left`): never a
    # second copy of the entry beside the cache. Not to a warm-up (it pins what it
    # stores), nor with a draft or quantized KV.
    hand_over = job.warm is None and speculator is None and kv_quant is None
    if use_cache:
        from_disk = disk if disk_on else None
        found = restore_longest(
            store,
            from_disk,
            job.cache_key,
            tokens,
            planner.grid,
            hand_over=hand_over,
            speculative=job.background,
        )
        if found.no_room:
            return None
    cache, reuse, lease = found.cache, found.reuse, found.lease
    if (trace := job.handle.trace) is not None:  # read by the request explainer (explain/)
        trace.source, trace.cached, trace.stored_match = found.source, reuse, found.matched
        trace.resumed_cancelled = found.kind is CheckpointKind.CANCELLED
        trace.admitted = True
    try:
        if cache is None:
            cache = make_prompt_cache(model.model)
        draft = None
        if speculator is not None and job.prompt.vision is None:
            first = planner.grid.chunk_ends(tokens, reuse)[0] - reuse
            draft = speculator.draft_for(found.snapshot, found.trim, reuse, first)
        checkpointer = None
        if use_cache:
            checkpointer = checkpointer_for(
                job,
                cache,
                reuse,
                found,
                planner=planner,
                store=store,
                disk=disk,
                disk_on=disk_on,
                waiting=waiting,
                share_min_tokens=share_min_tokens,
                kv_quant=kv_quant,
            )
            checkpointer.may_hand_back = hand_over and plain_kv_cache(cache)
            if job.background and found.handed_over:
                # The entry it was handed comes back inside its end (a hybrid's state
                # there, kept now): a next turn that leaves the prefetched reply (an
                # edit, a regeneration) still restores the previous prompt whole.
                checkpointer.rows.keep(reuse, CheckpointKind.HISTORY, True, lambda: None)
        if checkpointer is not None and draft is not None:
            checkpointer.draft = draft.cache
            part = found.snapshot.draft if found.snapshot is not None else None
            if reuse and draft.held == reuse and part is not None:
                checkpointer.draft_chain = part.chain.upto(reuse)
        cursor = PrefillCursor(tokens, reuse, planner.grid)
    except BaseException:
        if lease is not None:
            store.release(lease)
        raise
    key = bytes_key()
    now = time.perf_counter()
    return PrefillTask(job, cache, reuse, lease, cursor, now, key, checkpointer, draft)


def checkpointer_for(
    job: Job,
    cache: list,
    reuse: int,
    found: Restored,
    *,
    planner: PromptPlanner,
    store: PromptCache,
    disk: DiskAccess | None,
    disk_on: bool,
    waiting: Iterable[Job],
    share_min_tokens: int,
    kv_quant: KvQuant | None,
) -> Checkpointer:
    """What `job`'s prefill stores, from `reuse` on; to disk too where `disk_on`."""
    tokens = job.prompt.tokens
    shared = None
    if not always_trimmable(cache):

        def waiting_prompts() -> list[WaitingPrompt]:
            # Only requests of the same key may restore what this prefill stores: a
            # checkpoint made for another namespace would be a hit it can time.
            return [
                WaitingPrompt(j.serial, j.prompt.tokens)
                for j in waiting
                if j.cache_pref.enabled and j.cache_key == job.cache_key
            ]

        shared = SharedPrefixes(tokens, planner.grid, waiting_prompts, share_min_tokens)
    disk_positions: frozenset[int] = frozenset()
    if disk is not None and disk_on:

        def align(n: int) -> int:
            return planner.grid.align(tokens, n)

        disk_positions = frozenset(
            disk.positions(job.cache_key, job.prompt, align, job.cache_pref.scope)
        )

    def stored(position: int) -> None:
        job.stored_to = max(job.stored_to, position)

    return Checkpointer(
        job.prompt,
        cache,
        reuse,
        store,
        job.cache_key,
        shared,
        disk,
        disk_positions,
        found.branch,
        on_stored=stored,
        exact_only=kv_quant is not None and len(tokens) >= kv_quant.start,
        chain=found.chain,
        hand_back=found.handed_over,
    )
