"""An agent loop: tool definitions, a task, then scripted assistant turns that think
(`<think>...</think>`) and call tools, each followed by the tool's result; then the
answer and a follow-up question. Only the assistant turns are scripted: every request is
a real generation, its output ignored, as when an agent framework replays a transcript.

With a Qwen3-style template the follow-up is the hard case: the template drops the
earlier turns' reasoning once a new user query arrives, so the rendered history changes.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from ..client import Request, send
from ..corpus import passage
from ..harness import Context, ServerResult
from ..profiles import Sizes
from ..servers import Server

NAME = "agent"
TITLE = "Agent loop (tools + thinking)"
ASKED = "tool calls, thinking template"
_OFFSET = 7000


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(params)},
        },
    }


TOOLS = [
    _tool(
        "search_text",
        "Full-text search over the corpus; returns matching verses with "
        "book, chapter and verse numbers, best matches first.",
        query="words or a phrase to look for",
        book="optional book name to search within",
    ),
    _tool(
        "read_chapter",
        "Return the full text of one chapter.",
        book="book name, e.g. Genesis",
        chapter="chapter number",
    ),
    _tool(
        "cross_references",
        "List passages that quote or allude to a verse.",
        reference="a verse reference such as 'Genesis 1:1'",
    ),
    _tool(
        "write_note",
        "Append a note to the user's study notebook.",
        title="a short title",
        body="the note, in markdown",
    ),
]

SYSTEM = (
    "You are a research agent for a Bible study group. Work step by step: think about "
    "what you still need, call one tool at a time, read its result, and stop calling "
    "tools once you can answer. Cite every verse you rely on as Book chapter:verse. "
    "Keep notes short and factual. Never invent a reference: search for it instead."
)

_STEPS = [
    (
        "search_text",
        {"book": "Genesis", "query": "the firmament"},
        "The user wants the firmament passages. Search Genesis first.",
    ),
    (
        "read_chapter",
        {"book": "Genesis", "chapter": "1"},
        "The search points at chapter 1. Read it whole for context.",
    ),
    (
        "cross_references",
        {"reference": "Genesis 1:6"},
        "Verse 6 is the key one. Look for passages that allude to it.",
    ),
    (
        "write_note",
        {"body": "Genesis 1:6-8 and its echoes.", "title": "Firmament"},
        "Enough material; write a note before answering.",
    ),
]


def assistant_turn(step: int) -> dict[str, Any]:
    """The scripted assistant turn of `step`: a thought, then one tool call."""
    name, args, thought = _STEPS[step % len(_STEPS)]
    call = {
        "id": f"call_{step}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, sort_keys=True)},
    }
    return {
        "role": "assistant",
        "content": f"<think>\n{thought}\n</think>\n\nCalling {name}.",
        "tool_calls": [call],
    }


def describe(s: Sizes) -> str:
    return (
        f"{len(TOOLS)} tools, {s.agent_steps} thinking tool-call steps with "
        f"{s.agent_result_tokens}-token results, answer, follow-up question"
    )


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    p = ctx.sizes
    res = ServerResult(server.name)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": "What does Genesis say about the firmament, and where "
            "is it echoed later? Put the answer in my notebook.",
        },
    ]
    sent = []

    async def request(label: str) -> None:
        req = Request(messages=list(messages), tools=TOOLS, max_tokens=p.max_tokens)
        reply = await send(client, server, req)
        res.samples.append(ctx.account(server.name, label, req, reply))
        sent.append((label, req, reply))

    start = time.perf_counter()
    for step in range(p.agent_steps):
        await request(f"step {step + 1}")
        messages.append(assistant_turn(step))
        result = passage(_OFFSET + 300 * step, p.agent_result_tokens, ctx.tokens.count)
        messages.append({"role": "tool", "tool_call_id": f"call_{step}", "content": result})
    await request("answer")
    messages.append(
        {
            "role": "assistant",
            "content": "<think>\nI have what I need.\n</think>"
            "\n\nGenesis 1:6-8 describes the firmament dividing the waters.",
        }
    )
    messages.append({"role": "user", "content": "Thanks. Which later book echoes it most?"})
    await request("follow-up")
    res.wall_s = time.perf_counter() - start
    await ctx.check_warm(client, server, res, sent)
    return res
