"""Multi-turn chat: a growing conversation; each turn resends the whole history with the
server's own previous replies, as chat clients do."""

from __future__ import annotations

import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult
from ..servers import Server

NAME = "chat"
TITLE = "Multi-turn chat"
_OFFSET = 1000  # verses; each workload reads its own part of the text


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p, count = ctx.profile, ctx.tokens.count
    res = ServerResult(server.name)
    system = (
        "You are a patient teacher of English literature. Answer questions about the "
        "King James Bible plainly and briefly, quoting the text where it helps. Here is "
        "the chapter the class is reading:\n\n" + passage(_OFFSET, p.chat_system_tokens, count)
    )
    messages = [{"role": "system", "content": system}]
    turns = []
    start = time.perf_counter()
    for turn in range(1, p.chat_turns + 1):
        verse = passage(_OFFSET + 500 + 40 * turn, p.chat_user_tokens, count)
        messages.append({"role": "user", "content": f"What does this mean? {verse}"})
        req = Request(messages=list(messages), max_tokens=p.max_tokens)
        reply = await send(client, server.url, req)
        res.samples.append(ctx.account(server.name, f"turn {turn}", req, reply))
        messages.append({"role": "assistant", "content": reply.text})
        turns.append((f"turn {turn}", req, reply))
    res.wall_s = time.perf_counter() - start
    warm = turns[1:]
    for i, (label, req, reply) in enumerate(warm):
        if ctx.should_check(i, len(warm)):
            await ctx.check(client, server, res, label, req, reply)
    return res
