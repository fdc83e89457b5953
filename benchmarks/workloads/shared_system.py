"""One long system prompt shared by requests whose user messages diverge."""

from __future__ import annotations

import time

import httpx

from ..client import Request, send
from ..corpus import passage, sentence
from ..harness import Context, ServerResult
from ..profiles import Sizes
from ..servers import Server

NAME = "shared_system"
TITLE = "Shared system prompt"
ASKED = "divergent user messages"
_OFFSET = 4000


def describe(s: Sizes) -> str:
    return f"{s.shared_users} users, {s.shared_system_tokens}-token system prompt"


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p = ctx.sizes
    res = ServerResult(server.name)
    system = (
        "You are the reading assistant of a study group. Use only the reference text "
        "below; say so when it does not answer the question.\n\nReference text:\n"
        + passage(_OFFSET, p.shared_system_tokens, ctx.tokens.count)
    )
    sent = []
    start = time.perf_counter()
    for i in range(1, p.shared_users + 1):
        user = f"Question {i}: who is meant in the verse '{sentence(_OFFSET + 900 + 17 * i)}'?"
        req = Request(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            max_tokens=p.max_tokens,
        )
        reply = await send(client, server, req)
        res.samples.append(ctx.account(server.name, f"user {i}", req, reply))
        sent.append((f"user {i}", req, reply))
    res.wall_s = time.perf_counter() - start
    await ctx.check_warm(client, server, res, sent)
    return res
