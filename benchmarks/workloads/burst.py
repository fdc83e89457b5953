"""A burst of parallel requests sharing one ~500-token instruction (a browser extension
processing several page snippets at once): a cold burst, then a warm one with new
snippets. mlx-prefix prefills them one at a time on its chunk grid, computing the
shared prefix once (in-flight sharing), and decodes them as a batch; mlx_lm.server
batches prefill and decode."""

from __future__ import annotations

import asyncio
import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult
from ..profiles import Sizes
from ..servers import Server

NAME = "burst"
TITLE = "Parallel burst, shared instruction"
ASKED = "6 parallel requests, ~500-token instruction"
_OFFSET = 10000


def _instruction(ctx: Context) -> str:
    head = (
        "You are a browser extension's summarizer. For the snippet after the rules, reply "
        "with one plain sentence under twenty words. Rules, with an example of the style "
        "to imitate:\n\n"
    )
    return head + passage(_OFFSET, ctx.sizes.burst_instruction_tokens, ctx.tokens.count)


def describe(s: Sizes) -> str:
    return (
        f"{s.burst_size} requests, {s.burst_instruction_tokens}-token instruction, "
        f"{s.burst_item_tokens}-token snippets; cold, then warm"
    )


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p = ctx.sizes
    res = ServerResult(server.name)
    instruction = _instruction(ctx)
    bursts = []
    start = time.perf_counter()
    for phase, base in (("cold", 1000), ("warm", 2000)):
        reqs = [
            Request(
                messages=[
                    {"role": "system", "content": instruction},
                    {
                        "role": "user",
                        "content": "Snippet: "
                        + passage(_OFFSET + base + 60 * i, p.burst_item_tokens, ctx.tokens.count),
                    },
                ],
                max_tokens=p.max_tokens,
            )
            for i in range(p.burst_size)
        ]
        t = time.perf_counter()
        replies = await asyncio.gather(*(send(client, server.url, r) for r in reqs))
        res.extra[f"{phase}_wall_s"] = time.perf_counter() - t
        # Wall times compare like with like only if both servers generated as much.
        res.extra[f"{phase}_completion_tokens"] = sum(r.completion_tokens or 0 for r in replies)
        for i, (req, reply) in enumerate(zip(reqs, replies, strict=True)):
            label = f"{phase} #{i + 1}"
            res.samples.append(ctx.account(server.name, label, req, reply, group=phase))
            bursts.append((phase, label, req, reply))
    res.wall_s = time.perf_counter() - start
    # Both bursts against cold twins: the cold one is the in-flight sharing path (its
    # later requests restore what the first computed), the warm one the cache.
    for phase in ("cold", "warm"):
        rows = [b for b in bursts if b[0] == phase]
        for i, (_, label, req, reply) in enumerate(rows):
            if ctx.should_check(i, len(rows)):
                await ctx.check(client, server, res, label, req, reply)
    return res
