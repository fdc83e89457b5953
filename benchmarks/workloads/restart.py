"""Restart with the disk tier: two requests sharing a long system prompt, then one
request with another (~1K-token) system prompt seen only once (issue 14: `auto`
persists a system prompt the first time it sees it), the server process restarted,
and the first request of each again. mlx-prefix runs with `--cache-dir` (its disk
tier); mlx_lm.server has no disk tier, so its requests after the restart are cold again.

The warm/cold checks after the restart cost nothing extra: each request's first run
before the restart is the same request, run cold (in a fresh process, or on a prompt
the server had not seen).

Skips (with a note) while mlx-prefix has no `--cache-dir` flag or its `GET /v1/cache`
reports no disk section.
"""

from __future__ import annotations

import asyncio
import tempfile
import time

import httpx

from ..client import Reply, Request, send
from ..corpus import passage
from ..harness import Check, Context, ServerResult, run_async
from ..profiles import Sizes
from ..servers import OURS, PEER, Server, ServerSpec, ours_help

NAME = "restart"
TITLE = "Restart with the disk tier"
ASKED = "2,000-token system prompt"
_OFFSET = 21000


def describe(s: Sizes) -> str:
    return (
        f"{s.restart_system_tokens}-token system prompt, 2 questions; "
        f"{s.restart_once_system_tokens}-token one, 1 question; restart, both again"
    )


_COLD_HOW = "the same request, run first in the fresh process before the restart"
_ONCE_HOW = "the same request, run before the restart on a system prompt not seen before"
ONCE = "one request"  # labels of the request seen once, before and after the restart
ONCE_AFTER = "one request, after restart"


class Skip(Exception):
    pass


def _requests(ctx: Context) -> list[Request]:
    system = "You are a careful assistant. The user's reference material follows.\n\n" + passage(
        _OFFSET, ctx.sizes.restart_system_tokens, ctx.tokens.count
    )
    questions = ("Summarize the reference in a line.", "Which names appear in the reference?")
    return [
        Request(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=ctx.sizes.max_tokens,
        )
        for q in questions
    ]


def _once_request(ctx: Context) -> Request:
    """A request whose system prompt no other request shares."""
    system = "You are a travel guide to the places the notes below mention.\n\n" + passage(
        _OFFSET + 300, ctx.sizes.restart_once_system_tokens, ctx.tokens.count
    )
    return Request(
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": "Which place would you visit first?"},
        ],
        max_tokens=ctx.sizes.max_tokens,
    )


async def _disk_stats(server: Server, client: httpx.AsyncClient) -> dict | None:
    if server.name != OURS:
        return None
    body = (await client.get(server.url + "/v1/cache")).json()
    return body.get("disk") or body.get("stats", {}).get("disk")


async def _before(
    ctx: Context,
    server: Server,
    client: httpx.AsyncClient,
    res: ServerResult,
    reqs: list[Request],
    ledger,
) -> tuple[dict | None, list[Reply]]:
    # Two requests sharing the system prompt: the default disk scope (auto) persists the
    # longest prefix recent requests share. Then one whose system prompt is new: auto
    # persists it the first time it sees it.
    replies = []
    labels = [f"before restart #{i + 1}" for i in range(len(reqs) - 1)] + [ONCE]
    for label, req in zip(labels, reqs, strict=True):
        reply = await send(client, server, req)
        res.samples.append(ctx.account(server.name, label, req, reply, ledger=ledger))
        replies.append(reply)
    disk = await _disk_stats(server, client)
    deadline = time.monotonic() + 60
    while disk and disk.get("pending_saves") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        disk = await _disk_stats(server, client)
    return disk, replies


def run_standalone(ctx: Context) -> dict[str, ServerResult]:
    if "--cache-dir" not in ours_help():
        raise Skip("mlx-prefix serve has no --cache-dir flag yet (disk tier not built)")
    reqs = [*_requests(ctx), _once_request(ctx)]
    out = {}
    with tempfile.TemporaryDirectory(prefix="mlx-prefix-bench-disk-") as cache_dir:
        specs = {
            OURS: ServerSpec(OURS, ctx.model.path, ("--cache-dir", cache_dir), "ours-disk"),
            PEER: ServerSpec(PEER, ctx.model.path, (), "peer-restart"),
        }
        for name, spec in specs.items():
            res = ServerResult(name)
            server = Server(spec, ctx.out_dir / "logs").start()
            try:
                # One ledger across the restart: what the disk tier saves us is exactly the
                # work the earlier process already did.
                ledger = ctx.ledger(f"{name}:restart")
                start = time.perf_counter()
                disk, before = run_async(
                    lambda c, s=server, r=res, led=ledger: _before(ctx, s, c, r, reqs, led)
                )
                if name == OURS and disk is None:
                    raise Skip("GET /v1/cache reports no disk section (disk tier not built)")
                res.extra["disk_before_restart"] = disk
                t = time.perf_counter()
                server.restart()
                res.extra["restart_s"] = time.perf_counter() - t
                again = run_async(lambda c, s=server: send(c, s, reqs[0]))
                res.samples.append(
                    ctx.account(name, "after restart", reqs[0], again, ledger=ledger)
                )
                once = run_async(lambda c, s=server: send(c, s, reqs[-1]))
                res.samples.append(ctx.account(name, ONCE_AFTER, reqs[-1], once, ledger=ledger))
                res.wall_s = time.perf_counter() - start - res.extra["restart_s"]
                res.extra["disk_after_restart"] = run_async(lambda c, s=server: _disk_stats(s, c))
                if ctx.sizes.check_last is None:
                    run_async(
                        lambda c, s=server, r=res, w=before[1]: ctx.check(
                            c, s, r, "before restart #2", reqs[1], w
                        )
                    )
                for label, warm, cold, how in (
                    ("after restart", again.text, before[0].text, _COLD_HOW),
                    (ONCE_AFTER, once.text, before[-1].text, _ONCE_HOW),
                ):
                    res.checks.append(Check(label, warm == cold, warm, cold, how))
            finally:
                server.stop()
            out[name] = res
    return out
