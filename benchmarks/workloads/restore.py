"""Cache restore cost at 1K/8K/32K tokens (workload `restore`, in-process, once per
run): mlx-prefix snapshots vs mlx-lm's LRUPromptCache, on a KV cache shaped like the dense
default model (30 layers, 3 KV heads, head dim 64, float32). Both servers' rows live in
one table (`extra["rows"]`, see Row).

For each prefix length, a KVCache list shaped like a small model holds the prefix
(step-padded like a live request's). We time and measure:
  restore          snapshot.restore(snap) incl. mx.eval of the restored state
  lookup+restore   PromptCache.match + acquire + restore + release
  mlx-lm fetch     LRUPromptCache.fetch_nearest_cache (trie walk + deepcopy) + mx.eval
                   (MLX 0.32's deepcopy of an mx.array shares its buffer: no copy either)
  first write      one decode token into every layer of the restored cache + eval
                   (where copy-on-write pays for the copy, for both)
and the extra active MLX memory each leaves behind (mx.get_active_memory).

    python -m benchmarks.workloads.restore [--tokens 1024,8192,32768] [--repeat 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache

from mlx_prefix.cache.snapshot import Snapshot, capture, restore
from mlx_prefix.cache.store import CheckpointKind, PromptCache
from mlx_prefix.cache.token_ids import TokenIds

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
    args = argparse.Namespace(**SHAPE, pad=100, repeat=sizes.restore_repeat)
    ours, peer = ServerResult(OURS), ServerResult(PEER)
    ours.notes.append("in-process: mlx_prefix.cache PromptCache.match + snapshot.restore")
    peer.notes.append("in-process: mlx_lm LRUPromptCache.fetch_nearest_cache")
    start = time.perf_counter()
    rows = [asdict(bench(n, args)) for n in sizes.restore_tokens]
    wall = time.perf_counter() - start
    for res in (ours, peer):
        res.wall_s = wall
        res.extra["rows"] = rows
        res.extra["shape"] = SHAPE
    return {OURS: ours, PEER: peer}


@dataclass(frozen=True, slots=True)
class Row:
    tokens: int  # cached prefix length
    prefix_mib: float  # bytes of the cached prefix (all layers, K and V)
    restore_ms: float  # median snapshot.restore (+ eval)
    lookup_restore_ms: float  # median PromptCache.match/acquire + restore + release
    mlx_lm_fetch_ms: float  # median LRUPromptCache.fetch_nearest_cache (+ eval)
    restore_extra_mib: float  # active memory added by one restore
    mlx_lm_extra_mib: float  # active memory added by one fetch
    first_write_ms: float  # one decode token into a restored cache (ours)
    mlx_lm_first_write_ms: float  # the same into a fetched cache
    first_write_extra_mib: float  # memory after that first write (ours)
    mlx_lm_first_write_extra_mib: float


MiB = 1 << 20


def make_cache(n: int, layers: int, heads: int, dim: int, pad: int) -> list[KVCache]:
    """A live request's cache after `n` tokens: buffers step-padded past `n`."""
    size = -(-(n + pad) // KVCache.step) * KVCache.step
    cache = []
    for i in range(layers):
        k = mx.random.normal((1, heads, size, dim), key=mx.random.key(i))  # [B, H, L, D]
        v = mx.random.normal((1, heads, size, dim), key=mx.random.key(i + layers))
        cache.append(KVCache.from_state((k, v, n)))
    mx.eval([c.state for c in cache])
    return cache


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
        del out
    return statistics.median(times)


def extra_mib(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    base = mx.get_active_memory()
    out = fn()
    return (mx.get_active_memory() - base) / MiB, out


def first_write(cache: list[Any], heads: int, dim: int) -> None:
    k = mx.zeros((1, heads, 1, dim))
    out = [c.update_and_fetch(k, k) for c in cache]
    mx.eval(out)


def eval_state(cache: list[Any]) -> list[Any]:
    mx.eval([c.state for c in cache])
    return cache


def bench(n: int, args: argparse.Namespace) -> Row:
    tokens = list(range(n))
    # The prefix plus one new token, as the engine holds a prompt: token ids packed once
    # at render time (RenderedPrompt.tokens), in the caller's thread, not per lookup.
    query = TokenIds([*tokens, -1])
    lru_query = [*tokens, -1]  # what mlx-lm's LRUPromptCache takes
    source = make_cache(n, args.layers, args.heads, args.dim, args.pad)
    snap: Snapshot = capture(source, n)

    store = PromptCache(budget_bytes=1 << 40)
    store.insert("m", tokens, snap, CheckpointKind.HISTORY)

    def lookup_restore() -> list[Any]:
        m = store.match("m", query, lambda x: x)
        assert m.reuse_tokens == n
        payload = store.acquire(m.entry_id)
        try:
            return restore(payload, trim=m.trim)
        finally:
            store.release(m.entry_id)

    lru = LRUPromptCache(max_size=10)
    lru.insert_cache("m", tokens, source)

    def fetch() -> list[Any]:
        cache, rest = lru.fetch_nearest_cache("m", lru_query)
        assert rest == [-1]
        return eval_state(cache)

    restore_ms = median_ms(lambda: restore(snap), args.repeat)
    lookup_ms = median_ms(lookup_restore, args.repeat)
    fetch_ms = median_ms(fetch, args.repeat)
    ours_mib, ours = extra_mib(lambda: restore(snap))
    theirs_mib, theirs = extra_mib(fetch)

    def timed_write(cache: list[Any]) -> tuple[float, float]:
        gc.collect()
        base = mx.get_active_memory()
        t = time.perf_counter()
        first_write(cache, args.heads, args.dim)
        ms = (time.perf_counter() - t) * 1e3
        return ms, (mx.get_active_memory() - base) / MiB

    fw_ms, fw_mib = timed_write(ours)
    fw_theirs_ms, fw_theirs_mib = timed_write(theirs)
    del ours, theirs
    return Row(
        tokens=n,
        prefix_mib=snap.nbytes / MiB,
        restore_ms=restore_ms,
        lookup_restore_ms=lookup_ms,
        mlx_lm_fetch_ms=fetch_ms,
        restore_extra_mib=ours_mib,
        mlx_lm_extra_mib=theirs_mib,
        first_write_ms=fw_ms,
        mlx_lm_first_write_ms=fw_theirs_ms,
        first_write_extra_mib=fw_mib,
        mlx_lm_first_write_extra_mib=fw_theirs_mib,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default="1024,8192,32768", help="comma-separated prefix lengths")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3, help="kv heads")
    p.add_argument("--dim", type=int, default=64, help="head dim (float32)")
    p.add_argument("--pad", type=int, default=100, help="tokens of buffer past the prefix")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument(
        "--out", type=Path, default=Path(__file__).parent.parent / "out" / "restore.json"
    )
    args = p.parse_args()

    rows = [bench(int(n), args) for n in args.tokens.split(",")]
    head = (
        f"{'tokens':>7} {'MiB':>7} {'restore ms':>11} {'lookup+rst':>11} {'mlx-lm ms':>10}"
        f" {'+MiB ours':>10} {'+MiB mlx':>9} {'1st write':>10} {'mlx 1st':>8}"
        f" {'+MiB w':>8} {'+MiB mlx w':>10}"
    )
    print(head)
    for r in rows:
        print(
            f"{r.tokens:>7} {r.prefix_mib:>7.1f} {r.restore_ms:>11.3f} {r.lookup_restore_ms:>11.3f}"
            f" {r.mlx_lm_fetch_ms:>10.3f} {r.restore_extra_mib:>10.2f} {r.mlx_lm_extra_mib:>9.2f}"
            f" {r.first_write_ms:>10.2f} {r.mlx_lm_first_write_ms:>8.2f}"
            f" {r.first_write_extra_mib:>8.1f} {r.mlx_lm_first_write_extra_mib:>10.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "restore",
        "shape": {"layers": args.layers, "kv_heads": args.heads, "head_dim": args.dim},
        "dtype": "float32",
        "repeat": args.repeat,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "rows": [asdict(r) for r in rows],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
