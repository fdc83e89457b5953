"""DistributedEngine: the engine of a model sharded over the ranks of an `mlx.launch`
group. Every rank runs the same engine steps on its own shard; rank 0 decides.

A forward of a sharded model is a collective: every rank must run the same forwards,
with the same shapes, in the same order. So every rank runs the same Engine, with the
same code for matching, restoring, prefill chunks, checkpoints, eviction and decoding;
what differs is its turn driver, Lockstep (engine/sharded/lockstep.py), through which
every input that is not already the same on every rank comes from rank 0: once per
turn, before any forward, rank 0 sends the turn's plan and every rank applies it, then
takes the step. Inside a step the remaining inputs are agreed where they arise: the
sampled tokens are rank 0's (group.Channel.agree_tokens), a disk hit is used only when
every rank's disk has it, and the startup probe's verdicts are combined. The stores
then hold the same entries (each for its own shard: in tensor mode every rank's cache
has the same size); a digest of each rank's engine state travels with every plan and a
difference stops the group (engine/sharded/failure.py) rather than serve from caches
that no longer agree. Rank 0 serves HTTP; the others have no callers.
"""

from __future__ import annotations

from dataclasses import replace

from mlx_prefix.config import CacheConfig, DiskConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.sharded.group import Channel, Cluster
from mlx_prefix.engine.sharded.lockstep import Lockstep
from mlx_prefix.models.load import LoadedModel

QUANTIZED_KV_SHARDED = (
    "--kv-bits is not supported on a model sharded over ranks (a quantized KV row "
    "decodes unbatched, and that path is not built for the group's agreed steps)"
)


def DistributedEngine(  # noqa: N802 - a constructor's name: builds this rank's Engine
    model: LoadedModel,
    cluster: Cluster,
    channel: Channel,
    cache_config: CacheConfig | None = None,
    engine_config: EngineConfig | None = None,
    disk_config: DiskConfig | None = None,
) -> Engine:
    """This rank's engine: an Engine whose turns are the group's (Lockstep, reached as
    `engine.turns`: its `cluster`, and `lost` for the watch)."""
    if engine_config is not None and engine_config.kv_bits is not None:
        raise ValueError(QUANTIZED_KV_SHARDED)
    config = engine_config or EngineConfig()
    turns = Lockstep(cluster, channel, config)
    disk = per_rank(disk_config, cluster)
    return Engine(
        model, cache_config, config, disk_config=disk, turns=turns, consensus=turns.consensus
    )


def per_rank(disk: DiskConfig | None, cluster: Cluster) -> DiskConfig | None:
    """Each rank's disk tier in a folder of its own, named by rank and world size: a
    restart with another world size finds no files (its keys differ too)."""
    if disk is None or disk.default_scope.off:
        return disk
    return replace(disk, directory=str(disk.path() / f"rank{cluster.rank}-of-{cluster.size}"))
