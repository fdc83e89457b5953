"""`mlx-prefix serve` on every rank of an `mlx.launch` group: the model sharded over the
ranks (engine/sharded/load.py), one DistributedEngine per rank (engine/sharded/distributed.py);
rank 0 serves HTTP, the others follow it until it stops the group.

    mlx.launch -n 2 --backend ring --python .venv/bin/python -m mlx_prefix serve --model M
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from mlx_prefix.config import ModelConfig
from mlx_prefix.engine.sharded.group import Channel, Cluster, detect_backend
from mlx_prefix.engine.sharded.watch import PeerWatch
from mlx_prefix.env import from_env
from mlx_prefix.errors import InvalidRequest, Unavailable

from .args import cache_config, disk_config, engine_config

if TYPE_CHECKING:
    import mlx.core as mx

    from mlx_prefix.engine.engine import Engine
    from mlx_prefix.server.settings import ServerSettings

log = logging.getLogger("mlx_prefix.server")

TERM_WAIT_S = 15.0  # a rank other than 0 told to stop waits this long for rank 0's stop


def launched_group() -> mx.distributed.Group | None:
    """The launcher's group when this process is one of several ranks, else None."""
    if detect_backend() == "unknown":
        return None
    import mlx.core as mx

    group = mx.distributed.init()
    return group if group.size() > 1 else None


def serve_sharded(
    args: argparse.Namespace, group: mx.distributed.Group, settings: ServerSettings
) -> int:
    from mlx_prefix.engine.sharded.distributed import QUANTIZED_KV_SHARDED, DistributedEngine
    from mlx_prefix.engine.sharded.load import load_sharded
    from mlx_prefix.engine.sharded.lockstep import Lockstep
    from mlx_prefix.server.app import serve

    keys = ("model", "adapter", "dtype", "chat_template", "use_default_chat_template",
            "chat_template_args", "trust_remote_code")  # fmt: skip
    cfg = from_env(ModelConfig, "MODEL", {k: getattr(args, k, None) for k in keys})
    if cfg.adapter is not None:
        raise InvalidRequest("--adapter is not supported on a model sharded over ranks")
    if engine_config(args).kv_bits is not None:
        raise InvalidRequest(QUANTIZED_KV_SHARDED)
    if getattr(args, "draft_model", None) is not None:
        raise InvalidRequest("--draft-model is not supported on a model sharded over ranks")
    channel = Channel(group)
    backend = detect_backend()
    model, cluster = load_sharded(
        cfg.model,
        channel,
        pipeline=args.pipeline,
        backend=backend,
        **cfg.load_options(),
    )
    watch = PeerWatch.connect(channel, backend)
    # Every rank keeps the same budget (their stores evict in lockstep): the flag's or
    # the fixed default, never one sized from each machine's own free memory.
    cache = dataclasses.replace(cache_config(args), budget_from_machine=False)
    engine = DistributedEngine(
        model, cluster, channel, cache, engine_config(args), disk_config(args)
    )
    assert isinstance(engine.turns, Lockstep)
    watch.start(engine.turns.lost)
    if not cluster.leader:
        return follow(engine, cluster)
    serve(engine, settings)
    return ended(engine)


def follow(engine: Engine, cluster: Cluster) -> int:
    """A rank other than 0: run the engine until rank 0 stops the group. Rank 0 decides
    when that is: SIGINT is ignored (a terminal's Ctrl-C reaches rank 0 too), and on
    SIGTERM this rank still waits up to TERM_WAIT_S for rank 0's stop."""
    rank = cluster.rank
    log.info("rank %d: %s", rank, cluster.describe())
    termed = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: termed.set())
    deadline = None
    while not engine.join(0.5) and engine.failure is None:
        if termed.is_set():
            deadline = deadline or time.monotonic() + TERM_WAIT_S
            if time.monotonic() > deadline:
                log.warning("rank %d: no stop from rank 0; exiting", rank)
                os._exit(143)  # the engine thread may sit in a collective: do not join it
    return ended(engine)


def ended(engine: Engine) -> int:
    """After serving: 0, or the group's failure as the CLI's one line and exit status 1.
    An engine thread still inside a collective with a dead rank never returns, so then
    the process exits without waiting for it."""
    if engine.failure is None:
        return 0
    if engine.join(2.0):
        raise Unavailable(engine.failure)
    print(f"mlx-prefix: error: {engine.failure}", file=sys.stderr, flush=True)
    os._exit(1)
