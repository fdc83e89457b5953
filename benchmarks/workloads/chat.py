"""Multi-turn chat: a growing conversation; each turn resends the whole history with the
server's own previous replies, as chat clients do, after a pause to read the reply (not
counted in the wall time). mlx-prefix prefills the reply again during that pause (its
next-turn prefetch); those tokens are read from /v1/cache and counted as prefill."""

from __future__ import annotations

import asyncio
import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult
from ..profiles import Sizes
from ..servers import OURS, Server


async def background_prefill(client: httpx.AsyncClient, server: Server) -> int:
    """Prompt tokens the server has prefilled in the background so far (0 for a server
    that does none)."""
    if server.name != OURS:
        return 0
    stats = (await client.get(server.url + "/v1/cache")).json()["stats"]
    return int(stats.get("prefetch", {}).get("tokens", 0))


NAME = "chat"
TITLE = "Multi-turn chat"
ASKED = "5+ turns, growing context"
_OFFSET = 1000  # verses; each workload reads its own part of the text


def describe(s: Sizes) -> str:
    return (
        f"{s.chat_turns} turns, {s.chat_system_tokens}-token system prompt, "
        f"{s.chat_user_tokens}-token questions, {s.chat_pause_s:g} s to read each reply"
    )


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p, count = ctx.sizes, ctx.tokens.count
    res = ServerResult(server.name)
    system = (
        "You are a patient teacher of English literature. Answer questions about the "
        "King James Bible plainly and briefly, quoting the text where it helps. Here is "
        "the chapter the class is reading:\n\n" + passage(_OFFSET, p.chat_system_tokens, count)
    )
    messages = [{"role": "system", "content": system}]
    turns = []
    background = await background_prefill(client, server)
    start = time.perf_counter()
    for turn in range(1, p.chat_turns + 1):
        if turn > 1:
            await asyncio.sleep(p.chat_pause_s)
        verse = passage(_OFFSET + 500 + 40 * turn, p.chat_user_tokens, count)
        messages.append({"role": "user", "content": f"What does this mean? {verse}"})
        req = Request(messages=list(messages), max_tokens=p.max_tokens)
        reply = await send(client, server, req)
        res.samples.append(ctx.account(server.name, f"turn {turn}", req, reply))
        messages.append({"role": "assistant", "content": reply.text})
        turns.append((f"turn {turn}", req, reply))
    res.wall_s = time.perf_counter() - start - p.chat_pause_s * (p.chat_turns - 1)
    res.background_tokens = await background_prefill(client, server) - background
    await ctx.check_warm(client, server, res, turns)
    return res
