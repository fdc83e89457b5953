"""mlx-prefix cache ls | clear: the disk cache, read or emptied without a server;
mlx-prefix cache explain: a running server's recent requests and why each missed
(cli/explain.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import explain


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["ls", "clear", "explain"])
    p.add_argument("--cache-dir", dest="directory", default=None)
    p.add_argument("--json", action="store_true", help="ls, explain: one JSON object per line")
    explain.add_arguments(p)


def cmd_cache(args: argparse.Namespace) -> int:
    if args.action == "explain":
        return explain.cmd_explain(args)
    from mlx_prefix.cache.disk.tier import DiskCache
    from mlx_prefix.config import DiskConfig
    from mlx_prefix.env import from_env

    config = from_env(DiskConfig, "DISK", {"directory": args.directory})
    if args.action == "clear":
        # No budget: a scan with a smaller budget than the server's would delete its files.
        disk = DiskCache(config.path(), budget_bytes=None)
        print(f"removed {disk.clear()} cached checkpoints from {config.path()}")
        return 0
    listing = DiskCache.listing(config.path())  # reads headers; changes nothing
    for e in listing.entries:
        if args.json:
            print(json.dumps(dataclasses.asdict(e)))
        else:
            print(
                f"{e.model_key}  {e.tokens:>7} tokens  {e.nbytes / 2**20:>9.1f} MiB  "
                f"{e.kind:<12} idle {e.idle_s:,.0f}s"
            )
    for bad in listing.bad:
        print(f"bad: {bad.name}: {bad.reason} (removed at the next start)", file=sys.stderr)
    total = sum(e.nbytes for e in listing.entries)
    where = config.path() if listing.exists else f"{config.path()} (no such folder)"
    print(
        f"{len(listing.entries)} checkpoints, {total / 2**20:.1f} MiB in {where}", file=sys.stderr
    )
    return 0
