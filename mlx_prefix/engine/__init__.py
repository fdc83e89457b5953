"""The engine: one thread owns the model and every MLX array; every other thread reaches
it through an `Engine` (engine.py: submit, warm, cache views and actions, shutdown),
typed for the server as `EngineAPI` (interface.py). Import each name from its module;
this package re-exports nothing. Its parts, top down:

    engine.py      Engine: the callers' side, holding its parts
    parts.py       the parts built whole: a store of its own, the disk access, the loop
    driver.py      the turn driver, how the engine thread takes its turns: LocalTurns
                   (one process)
    loop.py        EngineLoop: built from its phases, each turn schedule -> prefill -> decode
    cache_views.py what callers read of the cache, and the actions they take on it
    activity.py    what the engine is doing, published once per turn
    keys.py        cache entry keys (model identity, grid, kernels; namespace, salt)
    calibration.py what the engine checks at startup; with --deterministic it measures
                   the batch-invariant layers and probe.py checks them bit for bit
    sharded/       a model split over mlx.distributed ranks: every rank's engine in
                   lockstep under rank 0's plan (a turn driver), the group, the watch
    prefill/       the prefill phase: match, restore, grid chunks, checkpoints, disk
    decode/        the decode phase: the batch, sampling, logits processors, response
                   formats, text and stop strings, speculative decoding
    requests/      a request around the model: its Job (the floor every stage builds
                   on), handles, admission, the inbox, the waiting list, pacing,
                   next-turn prefetch
    forward/       MLX forwards: chunk runner, output head, quantized KV, and
                   --deterministic's batch-invariant layers
"""
