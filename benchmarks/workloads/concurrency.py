"""Throughput: requests/s with 1, 4, 8 and 16 concurrent clients, each sending short
chats that share a system prompt (a typical editor or extension load). Both servers batch
prefill and decoding; mlx-prefix also reuses the system prompt. Per client count: the
completion tokens (requests/s compare like with like only if both servers generated as
much) and the inter-token latency pooled over its requests."""

from __future__ import annotations

import asyncio
import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult, itl
from ..profiles import Sizes
from ..servers import Server

NAME = "concurrency"
TITLE = "Requests/s at 1 to 16 clients"
ASKED = "1, 4, 8 and 16 concurrent clients"
_OFFSET = 30000


def describe(s: Sizes) -> str:
    clients = "/".join(str(c) for c in s.concurrency_clients)
    return (
        f"{clients} clients x {s.concurrency_requests_per_client} requests, "
        f"{s.concurrency_system_tokens}-token system prompt"
    )


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p = ctx.sizes
    res = ServerResult(server.name)
    system = "You answer questions about the text you are given, briefly. " + passage(
        _OFFSET, p.concurrency_system_tokens, ctx.tokens.count
    )
    res.extra["itl"] = {}
    start = time.perf_counter()
    serial = 0
    last: list = []
    for clients in p.concurrency_clients:

        async def one_client(c: int, clients: int = clients) -> None:
            nonlocal serial
            for k in range(p.concurrency_requests_per_client):
                serial += 1
                question = passage(_OFFSET + 500 + 37 * serial, 24, ctx.tokens.count)
                req = Request(
                    messages=[
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Client {c}, question {k}: {question}"},
                    ],
                    max_tokens=p.max_tokens,
                )
                reply = await send(client, server, req)
                label = f"{clients} clients"
                res.samples.append(ctx.account(server.name, label, req, reply, group=str(clients)))
                last[:] = [label, req, reply]

        t = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(clients)))
        total = clients * p.concurrency_requests_per_client
        res.extra[f"rps_{clients}"] = total / (time.perf_counter() - t)
        level = [s for s in res.samples if s.group == str(clients)]
        res.extra[f"completion_tokens_{clients}"] = sum(s.completion_tokens or 0 for s in level)
        res.extra["itl"][str(clients)] = itl(level)
    res.wall_s = time.perf_counter() - start
    if last:  # a batched reply against the same request served cold
        await ctx.check(client, server, res, *last)
    return res
