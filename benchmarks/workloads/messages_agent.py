"""A coding agent's session over Anthropic's Messages API, shaped like Claude Code's:
a long system prompt and tool list (system blocks: a billing header, then the prompt
with `cache_control`; the last tool and the newest message block marked too), a task,
then tool turns: each assistant turn thinks and calls one tool, each result comes back
as a `tool_result` block, and every request streams.

mlx-prefix gets the session on POST /v1/messages. mlx_lm.server has no Messages API, so
it gets the same conversation the way a translating proxy would send it, on POST
/v1/chat/completions: the system blocks joined (billing header first), tool_use as
`tool_calls`, tool_result as `tool` messages. In `messages_agent` the header is the one
Claude Code 2.1.328 sends in `-p` mode, constant through a session; in
`messages_agent_cch` it rotates its `cch=` on every request, as Claude Code has done
since 2.1.29 in interactive sessions (a hash of the request; anthropics/claude-code#68900,
sgl-project/sglang#21064): the case that wipes a prefix cache which renders the header
first. mlx-prefix leaves the header out of the prompt either way.

The random-weight models' replies are noise, so the assistant turns are scripted (an
agent framework replaying a transcript): every request is a real generation whose
output is ignored, and no reply is ever sent back, so the next-turn prefetch (on, as by
default) has no reply of the session to prefill. Reuse is judged on the requests' path.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import httpx

from ..client import Reply, Request, send
from ..corpus import passage
from ..harness import Check, Context, ServerResult
from ..profiles import Sizes
from ..servers import OURS, Server
from .agent import TOOLS

NAME = "messages_agent"
TITLE = "Agent session over /v1/messages"
ASKED = "8 tool turns, ~20K-token system prompt + tools"
_OFFSET = 12000
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.593; cc_entrypoint=sdk-cli;"
EPHEMERAL = {"type": "ephemeral"}
_STEPS = [
    ("search_text", {"query": "the firmament", "book": "Genesis"}, "Search Genesis first."),
    ("read_chapter", {"book": "Genesis", "chapter": "1"}, "Read the chapter whole."),
    ("cross_references", {"reference": "Genesis 1:6"}, "Find where verse 6 is echoed."),
    ("search_text", {"query": "waters above", "book": "Psalms"}, "Check the Psalms too."),
    ("read_chapter", {"book": "Psalms", "chapter": "148"}, "Psalm 148 mentions it."),
    ("write_note", {"title": "Firmament", "body": "Genesis 1:6-8."}, "Note what I have."),
]


def describe(s: Sizes) -> str:
    return (
        f"{s.messages_turns} tool turns, {s.messages_system_tokens}-token system prompt, "
        f"{len(TOOLS)} tools, {s.messages_result_tokens}-token tool results"
    )


def _anthropic_tools() -> list[dict[str, Any]]:
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    tools[-1]["cache_control"] = EPHEMERAL
    return tools


class Session:
    """One session's conversation, kept in both wire forms as it grows."""

    def __init__(self, system: str, task: str, *, rotating_header: bool = False):
        self.system = system
        self.rotating_header = rotating_header
        self.blocks: list[dict[str, Any]] = [{"role": "user", "content": [_text(task)]}]
        self.chat: list[dict[str, Any]] = [{"role": "user", "content": task}]

    def add_turn(self, step: int, result: str) -> None:
        name, args, thought = _STEPS[step % len(_STEPS)]
        call_id = f"toolu_{step:02d}"
        text = f"Calling {name}."
        self.blocks.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": thought, "signature": ""},
                    _text(text),
                    {"type": "tool_use", "id": call_id, "name": name, "input": args},
                ],
            }
        )
        self.blocks.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}],
            }
        )
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        self.chat.append(
            {
                "role": "assistant",
                "content": text,
                "reasoning_content": thought,
                "tool_calls": [call],
            }
        )
        self.chat.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})

    def header(self) -> str:
        """The billing header of the next request: constant, or with a `cch=` hashed
        from the conversation so far, so it changes with every request."""
        if not self.rotating_header:
            return BILLING
        digest = hashlib.sha256(json.dumps(self.blocks).encode()).hexdigest()[:5]
        return (
            f"x-anthropic-billing-header: cc_version=2.1.175.01c; cc_entrypoint=cli; cch={digest};"
        )

    def messages_body(self, max_tokens: int, *, cold: bool = False) -> dict[str, Any]:
        messages = json.loads(json.dumps(self.blocks))
        messages[-1]["content"][-1]["cache_control"] = EPHEMERAL  # as Claude Code marks it
        body = {
            "model": "claude-opus-5-5",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "system": [_text(self.header()), {**_text(self.system), "cache_control": EPHEMERAL}],
            "tools": _anthropic_tools(),
            "messages": messages,
        }
        if cold:
            body["prefix_cache"] = {"enabled": False}
        return body

    def chat_request(self, max_tokens: int, *, header: bool) -> Request:
        system = (self.header() if header else "") + self.system
        return Request(
            messages=[{"role": "system", "content": system}, *self.chat],
            tools=TOOLS,
            max_tokens=max_tokens,
        )


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


async def send_messages(client: httpx.AsyncClient, base_url: str, body: dict[str, Any]) -> Reply:
    """One streamed /v1/messages request, timed like client.send: TTFT at the first
    content delta; the text joins reasoning, text and tool input in stream order."""
    texts: list[str] = []
    usage: dict[str, Any] = {}
    ttft, stop = None, None
    start = time.perf_counter()
    async with client.stream("POST", base_url + "/v1/messages", json=body, timeout=None) as r:
        if r.status_code != 200:
            detail = (await r.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"{base_url}/v1/messages: HTTP {r.status_code}: {detail}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "error":
                raise RuntimeError(f"{base_url}/v1/messages: {event['error']}")
            if kind == "message_start":
                usage = event["message"]["usage"]
            elif kind == "content_block_delta":
                delta = event["delta"]
                text = delta.get("text") or delta.get("thinking") or delta.get("partial_json")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    texts.append(text)
            elif kind == "message_delta":
                usage = {**usage, **event["usage"]}
                stop = event["delta"]["stop_reason"]
    read = usage.get("cache_read_input_tokens", 0)
    prompt = usage.get("input_tokens", 0) + usage.get("cache_creation_input_tokens", 0) + read
    return Reply(
        text="".join(texts),
        prompt_tokens=prompt,
        cached_tokens=read,
        completion_tokens=usage.get("output_tokens"),
        ttft_s=ttft,
        total_s=time.perf_counter() - start,
        finish_reason=stop,
    )


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    return await run_session(ctx, server, client, rotating_header=False, offset=_OFFSET)


async def run_session(
    ctx: Context,
    server: Server,
    client: httpx.AsyncClient,
    *,
    rotating_header: bool,
    offset: int,
) -> ServerResult:
    """One session; `offset` picks its reference text, so a second session shares no
    prefix with the first beyond the opening sentence."""
    p, count = ctx.sizes, ctx.tokens.count
    res = ServerResult(server.name)
    system = (
        "You are a research agent for a Bible study group. Think about what you still "
        "need, call one tool at a time, and cite every verse as Book chapter:verse. "
        "Reference material follows.\n\n" + passage(offset, p.messages_system_tokens, count)
    )
    task = "What does Genesis say about the firmament, and where is it echoed?"
    session = Session(system, task, rotating_header=rotating_header)
    ours = server.name == OURS
    sent: list[tuple[str, Any, Reply]] = []
    start = time.perf_counter()
    for turn in range(p.messages_turns + 1):
        label = "task" if turn == 0 else f"tool turn {turn}"
        # Reuse is counted on the prompt each server renders: without the header for ours.
        request = session.chat_request(p.max_tokens, header=not ours)
        if ours:
            body = session.messages_body(p.max_tokens)
            reply = await send_messages(client, server.url, body)
            sent.append((label, session.messages_body(p.max_tokens, cold=True), reply))
        else:
            reply = await send(client, server, request)
            sent.append((label, request, reply))
        res.samples.append(ctx.account(server.name, label, request, reply))
        if turn < p.messages_turns:
            result = passage(offset + 4000 + 200 * turn, p.messages_result_tokens, count)
            session.add_turn(turn, result)
    res.wall_s = time.perf_counter() - start
    warm = sent[1:]
    for i, (label, request, reply) in enumerate(warm):
        if not ctx.should_check(i, len(warm)):
            continue
        if ours:
            cold = await send_messages(client, server.url, request)
            how = "prefix_cache disabled"
            res.checks.append(Check(label, reply.text == cold.text, reply.text, cold.text, how))
        else:
            await ctx.check(client, server, res, label, request, reply)
    return res
