"""Restart with the disk tier: a long-system-prompt request, the server process
restarted, the same request again. mlx-prefix runs with `--cache-dir` (its disk tier);
mlx_lm.server has no disk tier, so its second request is cold again.

Skips (with a note) while mlx-prefix has no `--cache-dir` flag or its `GET /v1/cache`
reports no disk section.
"""

from __future__ import annotations

import tempfile
import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult, run_async
from ..servers import OURS, PEER, Server, ServerSpec, ours_help

NAME = "restart"
TITLE = "Restart with the disk tier"
_OFFSET = 21000


class Skip(Exception):
    pass


def _request(ctx: Context) -> Request:
    system = "You are a careful assistant. The user's reference material follows.\n\n" + passage(
        _OFFSET, ctx.profile.restart_system_tokens, ctx.tokens.count
    )
    return Request(
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": "Summarize the reference in a line."},
        ],
        max_tokens=ctx.profile.max_tokens,
    )


async def _before(server: Server, client: httpx.AsyncClient, req: Request):
    reply = await send(client, server.url, req)
    cache = (await client.get(server.url + "/v1/cache")).json() if server.name == OURS else {}
    return reply, cache


def run_standalone(ctx: Context) -> dict[str, ServerResult]:
    if "--cache-dir" not in ours_help():
        raise Skip("mlx-prefix serve has no --cache-dir flag yet (disk tier not built)")
    req = _request(ctx)
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
                ledger = ctx.ledger(f"{name}:restart")
                start = time.perf_counter()
                first, cache = run_async(lambda c, s=server: _before(s, c, req))
                if name == OURS and "disk" not in cache and "disk" not in cache.get("stats", {}):
                    raise Skip("GET /v1/cache reports no disk section (disk tier not built)")
                res.samples.append(ctx.account(name, "before restart", req, first, ledger=ledger))
                t = time.perf_counter()
                server.restart()
                res.extra["restart_s"] = time.perf_counter() - t
                second = run_async(lambda c, s=server: send(c, s.url, req))
                # After a restart nothing was computed in this process: every token is novel
                # to it; what the disk tier supplies shows up as cached tokens.
                res.samples.append(ctx.account(name, "after restart", req, second))
                res.wall_s = time.perf_counter() - start - res.extra["restart_s"]
                run_async(
                    lambda c, s=server, r=res, w=second: ctx.check(c, s, r, "after restart", req, w)
                )
            finally:
                server.stop()
            out[name] = res
    return out
