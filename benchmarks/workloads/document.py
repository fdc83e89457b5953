"""A long document with a question; then the same document edited in the middle (one
sentence inserted), same question; then a second question on the edited document."""

from __future__ import annotations

import time

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult
from ..profiles import Sizes
from ..servers import Server

NAME = "document"
TITLE = "Long document, edited mid-way"
ASKED = "4K+ tokens, then edited in the middle"
_OFFSET = 14000
_INSERT = "And in those days a scribe added this line, that the reader might take note."


def edit_middle(doc: str) -> str:
    mid = doc.find(". ", len(doc) // 2)
    mid = len(doc) // 2 if mid < 0 else mid + 2
    return doc[:mid] + _INSERT + " " + doc[mid:]


def describe(s: Sizes) -> str:
    return f"{s.document_tokens}-token document: question, edited, new question"


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p = ctx.sizes
    res = ServerResult(server.name)
    doc = passage(_OFFSET, p.document_tokens, ctx.tokens.count)
    system = "You answer questions about the document the user pastes. Be brief."
    q1 = "Question: who speaks first in this document, and to whom?"
    q2 = "Question: name two places this document mentions."
    plan = [
        ("original", doc, q1),
        ("edited", edit_middle(doc), q1),
        ("edited, new question", edit_middle(doc), q2),
    ]
    sent = []
    start = time.perf_counter()
    for label, text, question in plan:
        req = Request(
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"Document:\n{text}\n\n{question}"},
            ],
            max_tokens=p.max_tokens,
        )
        reply = await send(client, server, req)
        res.samples.append(ctx.account(server.name, label, req, reply))
        sent.append((label, req, reply))
    res.wall_s = time.perf_counter() - start
    await ctx.check_warm(client, server, res, sent)
    return res
