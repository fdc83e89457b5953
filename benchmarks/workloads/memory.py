"""Resident memory over many distinct requests under a cache byte cap: mlx-prefix with
`--cache-budget`, mlx_lm.server with `--prompt-cache-bytes` (same bytes). RSS of each
server process is read after every request."""

from __future__ import annotations

import time

import httpx

from ..client import Request, send
from ..corpus import snippet
from ..harness import Context, ServerResult, run_async
from ..profiles import Sizes
from ..servers import OURS, PEER, Server, ServerSpec

NAME = "memory"
TITLE = "Resident memory under a cache cap"
ASKED = "RSS over 200 requests under a cache byte cap"
_OFFSET = 18000
MiB = 1 << 20


def describe(s: Sizes) -> str:
    return (
        f"{s.memory_requests} requests, ~{s.memory_prompt_tokens}-token texts, "
        f"{s.memory_max_tokens}-token replies, cap {s.memory_cap / MiB:g} MiB"
    )


async def _drive(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p, count = ctx.sizes, ctx.tokens.count
    res = ServerResult(server.name)
    res.extra["cap"] = f"{p.memory_cap / MiB:g} MiB"
    rss = [server.rss_bytes()]
    system = "Summarize the user's text in one sentence."
    # Numbered, so no two requests share more than the system prompt.
    texts = [
        f"Text {i + 1}: " + snippet(_OFFSET + 25 * i, p.memory_prompt_tokens, count)
        for i in range(p.memory_requests)
    ]
    start = time.perf_counter()
    last = None
    for i, text in enumerate(texts):
        req = Request(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": text}],
            max_tokens=p.memory_max_tokens,
        )
        reply = await send(client, server, req)
        res.samples.append(
            ctx.account(
                server.name,
                f"request {i + 1}",
                req,
                reply,
                ledger=ctx.ledger(f"{server.name}:memory"),
            )
        )
        rss.append(server.rss_bytes())
        last = (f"request {i + 1}", req, reply)
    res.wall_s = time.perf_counter() - start
    res.extra["rss_mib"] = [None if r is None else r / MiB for r in rss]
    if server.name == OURS:
        stats = (await client.get(server.url + "/v1/cache")).json().get("stats", {})
        res.extra["cache_bytes_mib"] = stats.get("bytes", 0) / MiB
        res.extra["evictions"] = stats.get("evictions")
    if last is not None:
        await ctx.check(client, server, res, *last)
    return res


def run_standalone(ctx: Context) -> dict[str, ServerResult]:
    cap = ctx.sizes.memory_cap
    specs = {
        OURS: ServerSpec(OURS, ctx.model.path, ("--cache-budget", str(cap)), "ours-capped"),
        PEER: ServerSpec(PEER, ctx.model.path, ("--prompt-cache-bytes", str(cap)), "peer-capped"),
    }
    out = {}
    for name, spec in specs.items():
        # One at a time, so neither process's memory is measured under the other's load.
        server = Server(spec, ctx.out_dir / "logs").start()
        try:
            out[name] = run_async(lambda c, s=server: _drive(ctx, s, c))
        finally:
            server.stop()
    return out
