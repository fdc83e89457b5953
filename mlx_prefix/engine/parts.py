"""The engine thread's parts, each built whole for one Engine (engine.py): a store of its
own (unless a server's models share one), the disk tier's access, and the loop built
from its phases (prefill, decode) over one waiting list.

Each part's bytes count in the store's budget under keys of the engine's own (`owner`:
the store may be shared by several engines). Built in the caller's thread, before the
engine thread starts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from mlx_prefix.cache.disk.tier import DiskCache
from mlx_prefix.cache.eviction.policy import policy_named
from mlx_prefix.cache.sizing import default_budget
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.engine.activity import ActivityBoard
from mlx_prefix.engine.decode.lookup import PromptLookup
from mlx_prefix.engine.decode.phase import DecodePhase
from mlx_prefix.engine.decode.speculative import Speculator
from mlx_prefix.engine.driver import Turns
from mlx_prefix.engine.forward.kv_quant import KvQuant
from mlx_prefix.engine.loop import EngineLoop
from mlx_prefix.engine.prefill.disk_access import DiskAccess
from mlx_prefix.engine.prefill.phase import PrefillPhase
from mlx_prefix.engine.requests.jobs import Job, PrefetchStats
from mlx_prefix.engine.requests.lifecycle import Lifecycle
from mlx_prefix.engine.requests.prefetch import Prefetcher
from mlx_prefix.engine.requests.scheduler import WaitingList
from mlx_prefix.models.cost import kv_bytes_per_token
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.platform import available_memory
from mlx_prefix.prompt.request.plan import PromptPlanner


def sized(
    config: CacheConfig,
    model: LoadedModel,
    store: PromptCache | None,
    free: Callable[[], int | None] = available_memory,
) -> CacheConfig:
    """`config` with its budget sized from the memory `free()` says the loaded weights
    left, when it asks (cache/sizing.py), said once with the longest conversation it
    keeps. A shared store (another engine's) keeps its budget."""
    if not config.budget_from_machine or store is not None:
        return config
    budget = default_budget(free())
    print(budget.describe(kv_bytes_per_token(model)), file=sys.stderr)  # as cli/__init__.py
    return replace(config, budget_bytes=budget.nbytes, budget_from_machine=False)


def new_store(config: CacheConfig) -> PromptCache:
    """A store of its own for one engine (a server's models share one: server/served/pool.py)."""
    return PromptCache(
        config.budget_bytes,
        config.max_entries,
        policy=policy_named(config.eviction),
        pin_share=config.pin_share,
    )


def disk_access(
    config: DiskConfig | None,
    cache_config: CacheConfig,
    *,
    trimmable: bool,
    store: PromptCache,
    owner: str,
    shared: DiskCache | None,
    agree: Callable[[int], bool] | None,
) -> DiskAccess | None:
    """The engine's access to the disk tier (None: memory only)."""
    # A server-wide scope of "off" disables the tier: no folder, no files, and no
    # per-request scope can turn it back on.
    if config is None or config.default_scope.off or not cache_config.enabled:
        return None
    return DiskAccess(
        config, trimmable, store, bytes_key=f"{owner}-disk", cache=shared, agree=agree
    )


def build_loop(
    *,
    model: LoadedModel,
    planner: PromptPlanner,
    store: PromptCache,
    disk: DiskAccess | None,
    cache_config: CacheConfig,
    config: EngineConfig,
    turns: Turns,
    lifecycle: Lifecycle,
    kv_quant: KvQuant | None,
    speculator: Speculator | None,
    lookup: PromptLookup | None,
    board: ActivityBoard,
    prefetch: PrefetchStats,
    prefetcher: Prefetcher | None,
    can_batch: bool,
    owner: str,
    agree_tokens: Callable[[mx.array], mx.array] | None,
) -> EngineLoop:
    """The engine thread's loop from its phases, each complete (`agree_tokens`: a
    sharded group's, engine/driver.py's Consensus)."""
    waiting: WaitingList[Job] = WaitingList(turns.clock)
    prefill = PrefillPhase(
        model,
        planner,
        store,
        disk,
        cache_config,
        config,
        waiting,
        bytes_key=f"{owner}-prefill",
        kv_quant=kv_quant,
        speculator=speculator,
    )
    decode = DecodePhase(
        model,
        store,
        f"{owner}-batch",
        lifecycle.end,
        prefetcher.after_reply if prefetcher is not None else _no_follow_up,
        kv=kv_quant,
        speculator=speculator,
        lookup=lookup,
        reasoning=planner.reasoning,  # reasoning budgets' markers
        agree_tokens=agree_tokens,
    )
    return EngineLoop(
        model=model,
        config=config,
        lifecycle=lifecycle,
        waiting=waiting,
        prefill=prefill,
        decode=decode,
        pace=turns.pace,
        disk=disk,
        board=board,
        prefetch=prefetch,
        batchable=can_batch,
    )


def _no_follow_up(job: Job, reply: str) -> None:
    """No next-turn prefetch: a reply ends its request, nothing follows."""
