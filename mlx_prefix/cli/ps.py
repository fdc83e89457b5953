"""mlx-prefix ps: what the running server has loaded (its GET /v1/ps)."""

from __future__ import annotations

import argparse
import json
import sys

from mlx_prefix.errors import MlxPrefixError

from .client import api_key, get_json, server_url, url_args
from .models import human_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    url_args(p)
    p.add_argument("--json", action="store_true", help="the server's answer as JSON")


def cmd_ps(args: argparse.Namespace) -> int:
    url = server_url(args.url)
    status = get_json(url, "/v1/ps", api_key(args.api_key))
    if status is None:
        raise MlxPrefixError(f"no server at {url} (start one with mlx-prefix serve, or pass --url)")
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    rows = status.get("models", [])
    width = max([len(r["id"]) for r in rows] + [4])
    print(
        f"{'NAME':<{width}}  {'WEIGHTS':>10}  {'CACHE':>10}  {'RUNNING':>7}  {'IDLE':>8}  UNLOADS"
    )
    for r in rows:
        cache = r["cache"]
        print(
            f"{r['id']:<{width}}  {human_bytes(r['weights_bytes']):>10}  "
            f"{human_bytes(cache['bytes']):>10}  {r['running']:>7}  "
            f"{_seconds(r['idle_s']):>8}  {_unloads(r)}"
        )
    memory = status.get("memory", {})
    rss, cache = human_bytes(memory.get("rss_bytes")), human_bytes(memory.get("cache_bytes"))
    budget = human_bytes(memory.get("cache_budget_bytes"))
    print(f"process: RSS {rss}, prompt cache {cache} of {budget}", file=sys.stderr)
    return 0


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m{s % 60:02.0f}s"
    return f"{s / 3600:.0f}h{s % 3600 / 60:02.0f}m"


def _unloads(row: dict) -> str:
    if row.get("pinned"):
        return "never (pinned)"
    if row.get("unloads_in_s") is None:
        return "when another needs its room" if not row.get("default") else "stays (--model)"
    if row["running"]:
        return f"{_seconds(row['keep_alive_s'])} after its requests"
    return f"in {_seconds(row['unloads_in_s'])}"
