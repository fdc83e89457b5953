"""The engine: one thread owns the model and every MLX array; every other thread reaches
it through an `Engine` (submit, warm, cache views, shutdown), typed for the server as
`EngineAPI` (interface.py). Its parts, top down:

    engine.py      Engine: the callers' side (submit, warm, shutdown) and its construction
    loop.py        EngineLoop: the engine thread, each turn schedule -> prefill -> decode
    cache_views.py what callers read of the cache; activity.py what the engine is doing
    keys.py        cache entry keys (model identity, grid, kernels; namespace, salt)
    session.py     PrefixCacheSession: the library API without a server
    calibration.py what the engine checks at startup; with --deterministic it measures
                   the batch-invariant layers and probe.py checks them bit for bit
    requests/      a request around the model: jobs, handles, admission, the inbox,
                   the waiting list, pacing, next-turn prefetch
    prefill/       the prefill phase: match, restore, grid chunks, checkpoints, disk
    decode/        the decode phase: the batch, sampling, logits processors, response
                   formats, text and stop strings, speculative decoding
    forward/       MLX forwards: chunk runner, quantized KV, and --deterministic's
                   batch-invariant layers
    sharded/       a model split over mlx.distributed ranks: every rank's engine in
                   lockstep under rank 0's plan
"""

from __future__ import annotations

from mlx_prefix.lazy import exports

_NAMES = {
    "Engine": "engine",
    "EngineAPI": "interface",
    "RequestHandle": "requests.handle",
    "WarmResult": "requests.jobs",
    "PrefetchStats": "requests.jobs",
    "cache_key": "keys",
    "entry_key": "keys",
    "PrefixCacheSession": "session",
    "DistributedEngine": "sharded.distributed",
}
__all__ = list(_NAMES)
__getattr__ = exports(__name__, _NAMES)
