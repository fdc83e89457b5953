"""Cache restore cost at 1K/8K/32K tokens, through benchmarks/bench_restore.py: our
snapshot restore (copy-on-write) against mlx-lm's LRUPromptCache fetch, on a KV cache
shaped like the dense default model (30 layers, 3 KV heads, head dim 64, float32).
Both servers' rows live in one table (`extra["rows"]`, see bench_restore.Row)."""

from __future__ import annotations

import argparse
import dataclasses
import time

from ..harness import ServerResult
from ..models import BenchModel
from ..profiles import Sizes
from ..servers import OURS, PEER

NAME = "restore"
TITLE = "Cache restore cost"
ASKED = "1K/8K/32K cached tokens"
SHAPE = {"layers": 30, "heads": 3, "dim": 64}  # the dense default model's KV cache


def describe(s: Sizes) -> str:
    sizes = "/".join(f"{n // 1024}K" if n >= 1024 else str(n) for n in s.restore_tokens)
    return f"{sizes} tokens, median of {s.restore_repeat}"


def run_once(sizes: Sizes, model: BenchModel) -> dict[str, ServerResult]:
    from .. import bench_restore

    args = argparse.Namespace(**SHAPE, pad=100, repeat=sizes.restore_repeat)
    ours, peer = ServerResult(OURS), ServerResult(PEER)
    ours.notes.append("in-process: mlx_prefix.cache PromptCache.match + snapshot.restore")
    peer.notes.append("in-process: mlx_lm LRUPromptCache.fetch_nearest_cache")
    start = time.perf_counter()
    rows = [dataclasses.asdict(bench_restore.bench(n, args)) for n in sizes.restore_tokens]
    wall = time.perf_counter() - start
    for res in (ours, peer):
        res.wall_s = wall
        res.extra["rows"] = rows
        res.extra["shape"] = SHAPE
    return {OURS: ours, PEER: peer}
