"""Cache restore cost at 1K/8K/32K tokens, through benchmarks/bench_restore.py: our
snapshot restore (copy-on-write) against mlx-lm's LRUPromptCache fetch (deep copy), on a
KV cache shaped like the dense default model (30 layers, 3 KV heads, head dim 64)."""

from __future__ import annotations

import argparse
import dataclasses
import time

from ..harness import Context, ServerResult
from ..servers import OURS, PEER

NAME = "restore"
TITLE = "Cache restore cost"


def run_standalone(
    ctx: Context | None, tokens: tuple[int, ...], repeat: int
) -> dict[str, ServerResult]:
    from .. import bench_restore

    args = argparse.Namespace(layers=30, heads=3, dim=64, pad=100, repeat=repeat)
    ours, peer = ServerResult(OURS), ServerResult(PEER)
    ours.notes.append("in-process: mlx_prefix.cache.snapshot.restore via PromptCache")
    peer.notes.append("in-process: mlx_lm LRUPromptCache.fetch_nearest_cache")
    rows = []
    start = time.perf_counter()
    for n in tokens:
        rows.append(dataclasses.asdict(bench_restore.bench(n, args)))
    wall = time.perf_counter() - start
    for res in (ours, peer):
        res.wall_s = wall
        res.extra["rows"] = rows
    ours.extra["series"] = [
        {
            "tokens": r["tokens"],
            "restore_ms": r["lookup_restore_ms"],
            "extra_mib": r["restore_extra_mib"],
            "first_write_ms": r["first_write_ms"],
        }
        for r in rows
    ]
    peer.extra["series"] = [
        {
            "tokens": r["tokens"],
            "restore_ms": r["mlx_lm_fetch_ms"],
            "extra_mib": r["mlx_lm_extra_mib"],
            "first_write_ms": r["mlx_lm_first_write_ms"],
        }
        for r in rows
    ]
    return {OURS: ours, PEER: peer}
