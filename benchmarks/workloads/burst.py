"""A burst of parallel requests sharing one ~500-token instruction (a browser extension
processing several page snippets at once): a cold burst, then a warm one with new
snippets, then a cold burst on a new instruction whose requests each add ~150 unique
tokens (issue 15: the remainders must prefill side by side, not one after another).
mlx-prefix prefills several requests at once on its chunk grid, computing a shared
prefix once (in-flight sharing), and decodes them as a batch; mlx_lm.server batches
prefill and decode. Each burst also reports the inter-token latency of its requests:
what a running request's decode pays while the others prefill."""

from __future__ import annotations

import asyncio
import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult, itl
from ..profiles import Sizes
from ..servers import Server

NAME = "burst"
TITLE = "Parallel burst, shared instruction"
ASKED = "6 parallel requests, ~500-token instruction; warm; ~150 unique tokens each"
_OFFSET = 10000
PHASES = ("cold", "warm", "unique")  # extra keys: f"{phase}_wall_s", ...

_HEADS = (
    "You are a browser extension's summarizer. For the snippet after the rules, reply "
    "with one plain sentence under twenty words. Rules, with an example of the style "
    "to imitate:\n\n",
    "You are a reading-list assistant. Tag the passage after these notes with three "
    "keywords and nothing else. Notes on the collection it comes from:\n\n",
)


def _instruction(ctx: Context, which: int) -> str:
    start = _OFFSET + 3000 * which
    return _HEADS[which] + passage(start, ctx.sizes.burst_instruction_tokens, ctx.tokens.count)


def describe(s: Sizes) -> str:
    return (
        f"{s.burst_size} requests, {s.burst_instruction_tokens}-token instruction, "
        f"{s.burst_item_tokens}-token snippets; cold, then warm; then cold on a new "
        f"instruction with {s.burst_unique_tokens}-token snippets"
    )


def _requests(ctx: Context, phase: str) -> list[Request]:
    p = ctx.sizes
    # (instruction, where its snippets start, snippet tokens)
    which, base, n = {
        "cold": (0, 1000, p.burst_item_tokens),
        "warm": (0, 2000, p.burst_item_tokens),
        "unique": (1, 3100, p.burst_unique_tokens),
    }[phase]
    instruction = _instruction(ctx, which)
    return [
        Request(
            messages=[
                {"role": "system", "content": instruction},
                {
                    "role": "user",
                    "content": "Snippet: " + passage(_OFFSET + base + 60 * i, n, ctx.tokens.count),
                },
            ],
            max_tokens=p.max_tokens,
        )
        for i in range(p.burst_size)
    ]


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    res = ServerResult(server.name)
    bursts = []
    res.extra["itl"] = {}
    start = time.perf_counter()
    for phase in PHASES:
        reqs = _requests(ctx, phase)
        t = time.perf_counter()
        replies = await asyncio.gather(*(send(client, server, r) for r in reqs))
        res.extra[f"{phase}_wall_s"] = time.perf_counter() - t
        # Wall times compare like with like only if both servers generated as much.
        res.extra[f"{phase}_completion_tokens"] = sum(r.completion_tokens or 0 for r in replies)
        for i, (req, reply) in enumerate(zip(reqs, replies, strict=True)):
            label = f"{phase} #{i + 1}"
            res.samples.append(ctx.account(server.name, label, req, reply, group=phase))
            bursts.append((phase, label, req, reply))
        res.extra["itl"][phase] = itl([s for s in res.samples if s.group == phase])
    res.wall_s = time.perf_counter() - start
    res.extra["itl"]["all"] = itl(res.samples)
    # Every burst against cold twins: the cold ones are the in-flight sharing path (their
    # later requests restore what the first computed), the warm one the cache.
    for phase in PHASES:
        rows = [b for b in bursts if b[0] == phase]
        for i, (_, label, req, reply) in enumerate(rows):
            if ctx.should_check(i, len(rows)):
                await ctx.check(client, server, res, label, req, reply)
    return res
