"""mlx-prefix cache explain: a running server's recent requests, each with why it reused
what it did (GET /v1/cache/requests), as a table or one JSON object per line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from mlx_prefix.errors import MlxPrefixError

DEFAULT_URL = "http://127.0.0.1:8080"
TEXT_WIDTH = 48  # of each text in the table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("MLX_PREFIX_URL", DEFAULT_URL),
        help=f"explain: the server's base URL (env MLX_PREFIX_URL; default {DEFAULT_URL})",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLX_PREFIX_SERVER_API_KEY"),
        help="explain: the server's API key, if it has one (env MLX_PREFIX_SERVER_API_KEY)",
    )
    p.add_argument(
        "--limit", type=int, default=20, help="explain: how many recent requests (default 20)"
    )


def cmd_explain(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise MlxPrefixError("--limit must be at least 1")
    records = fetch(args.url, args.api_key, args.limit)
    if args.json:
        for record in records:
            print(json.dumps(record))
        return 0
    if not records:
        print("no request yet", file=sys.stderr)
        return 0
    print(table(records))
    return 0


def fetch(url: str, api_key: str | None, limit: int) -> list[dict[str, Any]]:
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/cache/requests?limit={limit}")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)["data"]
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error shape: say the status
            message = e.reason
        raise MlxPrefixError(f"{url} answered {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise MlxPrefixError(f"no mlx-prefix server at {url} ({reason})") from None


def table(records: list[dict[str, Any]]) -> str:
    rows = [("time", "request", "api", "reason", "cached", "lost", "where", "stored -> sent")]
    for r in records:
        where = "-"
        if r["diverged_at"] is not None:
            where = f"token {r['diverged_at']}"
            if r["location"]:
                where += f" msg {r['location']['message']} {r['location']['role']}"
        texts = r["detail"]
        if r["before"] is not None or r["after"] is not None:
            texts = f"{_clip(r['before'])} -> {_clip(r['after'])}"
        rows.append((
            time.strftime("%H:%M:%S", time.localtime(r["created"])),
            r["id"][:22], r["api"], r["reason"],
            f"{r['cached_tokens']}/{r['prompt_tokens']}", str(r["lost_tokens"]), where, texts,
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    )


def _clip(text: str | None) -> str:
    """A text on one line, at most TEXT_WIDTH characters, its edges shown by quotes."""
    flat = json.dumps(text or "", ensure_ascii=False)[1:-1]
    return repr(flat[:TEXT_WIDTH] + ("…" if len(flat) > TEXT_WIDTH else ""))
