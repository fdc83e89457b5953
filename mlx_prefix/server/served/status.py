"""What `mlx-prefix ps` shows (GET /v1/ps): the resident models, their memory, their
cache, how long each has been idle and when it unloads, and the process's memory.

Read on the event loop (the pool's state lives there) except the cache listings, which
the caller reads off it (`cache_use`: the thread-safe store and disk index, never an
MLX array).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mlx_prefix.config import FOREVER
from mlx_prefix.platform import available_memory, process_rss

from .lease import busy

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI

    from .idle import IdleUnloader
    from .pool import ModelPool


@dataclass(frozen=True)
class CacheUse:
    """One model's entries: in memory (this process) and on disk."""

    entries: int = 0
    bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0


@dataclass(frozen=True)
class ModelStatus:
    id: str
    folder: str | None
    adapter: str | None
    default: bool  # the server's --model
    context_length: int | None
    weights_bytes: int
    running: int  # requests in its engine (queued, prefilling or decoding)
    loaded_at: float  # unix time
    idle_s: float  # 0 while a request holds or runs in it
    keep_alive_s: float | None  # None: stays until a swap needs its room (or pinned)
    unloads_in_s: float | None  # None: never when idle
    pinned: bool
    cache: CacheUse


def cache_use(engine: EngineAPI) -> CacheUse:
    """Any thread: the model's memory-tier entries and checkpoint files."""
    memory = [s.info for s in engine.views.cache_sequences()]
    disk = [s.info for s in engine.views.disk_sequences()]
    return CacheUse(
        len(memory),
        sum(i.nbytes - getattr(i, "shared_bytes", 0) for i in memory),
        len(disk),
        sum(i.nbytes for i in disk),
    )


def model_statuses(
    pool: ModelPool, unloader: IdleUnloader | None, caches: dict[int, CacheUse]
) -> list[ModelStatus]:
    """Event loop: one row per resident model, the most recently used last; `caches`
    maps id(engine) to what `cache_use` read."""
    now = pool.clock()
    rows = []
    for slot in pool.slots():
        engine = slot.served.engine
        in_use = busy(slot)
        keep = pool.keep_alive_for(slot)
        idle = 0.0 if in_use else max(now - slot.last_used, 0.0)
        unloads_in = None if keep == FOREVER or unloader is None else max(keep - idle, 0.0)
        lifecycle = getattr(engine, "lifecycle", None)
        rows.append(
            ModelStatus(
                id=slot.spec.id,
                folder=str(slot.spec.folder),
                adapter=str(slot.spec.adapter) if slot.spec.adapter else None,
                default=slot.spec.default,
                context_length=engine.model.context_length,
                weights_bytes=slot.weights_bytes,
                running=lifecycle.pending if lifecycle is not None else 0,
                loaded_at=slot.loaded_at,
                idle_s=idle,
                keep_alive_s=None if keep == FOREVER else keep,
                unloads_in_s=unloads_in,
                pinned=pool.settings_for(slot.spec).pinned,
                cache=caches.get(id(engine), CacheUse()),
            )
        )
    return rows


def status_body(pool: ModelPool, rows: list[ModelStatus], stats: dict[str, Any]) -> dict[str, Any]:
    """GET /v1/ps's JSON: the rows, the server's own model (loaded or not: `rm` will not
    delete it), and the process's memory (`stats`: the shared store's cache_stats)."""
    import mlx.core as mx

    spec = pool.default_spec
    return {
        "default": {"id": spec.id, "folder": str(spec.folder)},
        "models": [asdict(r) for r in rows],
        "memory": {
            "rss_bytes": process_rss(),
            "available_bytes": available_memory(),
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
            "cache_bytes": stats.get("bytes", 0),
            "cache_active_bytes": stats.get("active_bytes", 0),
            "cache_budget_bytes": stats.get("budget_bytes"),
        },
    }
