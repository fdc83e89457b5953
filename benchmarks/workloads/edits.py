"""A document edited at several points (issue 14): a document is asked about once,
then asked again with one sentence inserted at 10%, 50%, 70% and 95% of it (each edit
of the original, in that order), at several document lengths. Per edit: the tokens the
server reported cached against the prompt's common prefix with everything this server
computed before (the most any cache could reuse). mlx_lm.server trims a dense model's
cached prefix to the exact edit; mlx-prefix resumes on its prefill grid (multiples of
`--prefill-chunk`, 256), so it recomputes up to 255 tokens before the edit even there.
A hybrid model resumes only from a stored checkpoint, so this measures where
checkpoints sit (mlx-prefix: at 64, 128, 256, then every 512 tokens, and at branch
points)."""

from __future__ import annotations

import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult
from ..profiles import Sizes
from ..servers import Server
from .chat import background_prefill

NAME = "edits"
TITLE = "Document edited at 10/50/70/95%"
ASKED = "1K, 4K and 16K-token documents edited at 10/50/70/95%"
_OFFSET = 15000
_INSERT = "And a scribe wrote in the margin that this page had been copied again."
_SYSTEM = "You read the user's document closely and answer in one short sentence."
_QUESTION = "Question: what happens first in this document?"


def edit_at(doc: str, fraction: float) -> str:
    """`doc` with one sentence inserted at the word boundary at or before `fraction` of
    its characters (so the text before the edit tokenizes as before)."""
    cut = doc.rfind(" ", 0, max(1, int(len(doc) * fraction)))
    cut = max(cut, 0)
    return doc[:cut] + " " + _INSERT + doc[cut:]


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def describe(s: Sizes) -> str:
    sizes = "/".join(_tokens(n) for n in s.edit_doc_tokens)
    at = "/".join(f"{round(100 * f)}%" for f in s.edit_positions)
    return f"{sizes}-token documents: asked, then edited at {at}"


def _request(ctx: Context, text: str) -> Request:
    return Request(
        messages=[
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": f"Document:\n{text}\n\n{_QUESTION}"},
        ],
        max_tokens=ctx.sizes.max_tokens,
    )


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p = ctx.sizes
    res = ServerResult(server.name)
    rows: list[dict] = []
    warm = []
    background = await background_prefill(client, server)
    start = time.perf_counter()
    for k, n in enumerate(p.edit_doc_tokens):
        doc = passage(_OFFSET + 600 * k, n, ctx.tokens.count)
        plan = [("original", None, doc)]
        plan += [(f"edit at {round(100 * f)}%", f, edit_at(doc, f)) for f in p.edit_positions]
        for label, fraction, text in plan:
            req = _request(ctx, text)
            common = ctx.ledger(server.name).common(ctx.prompt_ids(req))
            reply = await send(client, server, req)
            sample = ctx.account(server.name, f"{_tokens(n)} {label}", req, reply, group=str(n))
            res.samples.append(sample)
            if fraction is None:
                continue
            warm.append((sample.label, req, reply))
            rows.append(
                {
                    "doc_tokens": n,
                    "position": fraction,
                    "prompt": reply.prompt_tokens,
                    "common": common,
                    "cached": reply.cached_tokens,
                    "reuse": None
                    if reply.cached_tokens is None or not common
                    else reply.cached_tokens / common,
                }
            )
    res.wall_s = time.perf_counter() - start
    res.background_tokens = await background_prefill(client, server) - background
    res.extra["rows"] = rows
    for i, (label, req, reply) in enumerate(warm):
        if ctx.should_check(i, len(warm)):
            await ctx.check(client, server, res, label, req, reply)
    return res
