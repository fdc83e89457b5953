"""Mixed traffic under a small cache budget (issue 14): long documents asked about
again and again, multi-turn chats, an agent session with tools, and one-shot requests,
interleaved, against a cache budget far smaller than what they would keep. Three
servers, one after the other: mlx-prefix with value eviction (its default), mlx-prefix
with the fixed kind order (`--cache-eviction kind`), and mlx_lm.server with
`--prompt-cache-bytes` set to the same bytes. What counts is the prefill the cache saved:
the cached tokens the server reported, less the tokens it prefilled in the background
(next-turn prefetch), against the most any cache could have saved (each prompt's common
prefix with what that server computed before)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ..client import Reply, Request, send
from ..corpus import passage, sentence, snippet
from ..harness import Context, ServerResult, run_async
from ..profiles import Sizes
from ..servers import OURS, PEER, Server, ServerSpec
from .agent import SYSTEM as AGENT_SYSTEM
from .agent import TOOLS, assistant_turn
from .chat import background_prefill

NAME = "mixed"
TITLE = "Mixed traffic under a small cache budget"
ASKED = "long documents, chats, agent sessions, one-shots; value vs kind eviction"
_OFFSET = 8600
MiB = 1 << 20
OURS_KIND = "mlx-prefix (kind eviction)"  # the second mlx-prefix run's result key
KINDS = ("document", "chat", "agent", "one-shot")


def describe(s: Sizes) -> str:
    return (
        f"{s.mixed_docs} {s.mixed_doc_tokens}-token documents x {s.mixed_doc_questions} "
        f"questions, {s.mixed_chats} chats x {s.mixed_chat_turns} turns, an agent session "
        f"of {s.mixed_agent_steps} steps, {s.mixed_oneshots} one-shots, interleaved; "
        f"budget {s.mixed_budget / MiB:g} MiB"
    )


@dataclass
class _Actor:
    """One client: its requests in order, each built when it is sent (a chat's next turn
    holds the server's previous reply)."""

    kind: str
    name: str
    steps: int
    build: Callable[[int], Request]
    reply: Callable[[Reply], None] = lambda _reply: None


def _actors(ctx: Context) -> tuple[list[_Actor], list[_Actor]]:
    """The long-lived clients (documents, chats, the agent) and the one-shots."""
    p, count = ctx.sizes, ctx.tokens.count
    out: list[_Actor] = []
    for d in range(p.mixed_docs):
        doc = passage(_OFFSET + 250 * d, p.mixed_doc_tokens, count)

        def ask_doc(i: int, doc: str = doc, d: int = d) -> Request:
            question = f"Question {i + 1}: what does the verse '{sentence(_OFFSET + 97 * i)}' mean?"
            return Request(
                messages=[
                    {"role": "system", "content": f"You answer questions on document {d + 1}."},
                    {"role": "user", "content": f"Document:\n{doc}\n\n{question}"},
                ],
                max_tokens=p.max_tokens,
            )

        out.append(_Actor("document", f"doc {d + 1}", p.mixed_doc_questions, ask_doc))
    for c in range(p.mixed_chats):
        system = f"You are tutor number {c + 1}. Explain the text the student quotes.\n\n"
        system += passage(_OFFSET + 600 + 60 * c, p.chat_system_tokens, count)
        chat: list[dict[str, Any]] = [{"role": "system", "content": system}]

        def chat_turn(i: int, chat: list = chat, c: int = c) -> Request:
            start = _OFFSET + 800 + 40 * (c * p.mixed_chat_turns + i)
            verse = passage(start, p.chat_user_tokens, count)
            chat.append({"role": "user", "content": f"What does this mean? {verse}"})
            return Request(messages=list(chat), max_tokens=p.max_tokens)

        def chat_reply(reply: Reply, chat: list = chat) -> None:
            chat.append({"role": "assistant", "content": reply.text})

        out.append(_Actor("chat", f"chat {c + 1}", p.mixed_chat_turns, chat_turn, chat_reply))
    task = "Where does Genesis speak of the firmament? Note it for me."
    agent = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task}]

    def agent_step(i: int) -> Request:
        if i:  # the previous step's scripted tool call and the tool's result
            agent.append(assistant_turn(i - 1))
            result = passage(_OFFSET + 1100 + 30 * i, p.agent_result_tokens, count)
            agent.append({"role": "tool", "tool_call_id": f"call_{i - 1}", "content": result})
        return Request(messages=list(agent), tools=TOOLS, max_tokens=p.max_tokens)

    out.append(_Actor("agent", "agent", p.mixed_agent_steps, agent_step))
    shots = []
    for k in range(p.mixed_oneshots):
        text = f"Text {k + 1}: " + snippet(_OFFSET + 1300 + 20 * k, p.mixed_oneshot_tokens, count)

        def one_shot(_i: int, text: str = text) -> Request:
            return Request(
                messages=[
                    {"role": "system", "content": "Summarize the user's text in one sentence."},
                    {"role": "user", "content": text},
                ],
                max_tokens=p.max_tokens,
            )

        shots.append(_Actor("one-shot", f"one-shot {k + 1}", 1, one_shot))
    return out, shots


def schedule(actors: list[_Actor], shots: list[_Actor]) -> list[tuple[_Actor, int]]:
    """Round after round, each long-lived client's next request, the one-shots spread
    between them: every document comes back after the others have had a turn."""
    rounds = max((a.steps for a in actors), default=1)
    per_round = -(-len(shots) // rounds)
    out: list[tuple[_Actor, int]] = []
    for r in range(rounds):
        turn = [a for a in actors if r < a.steps]
        extra = shots[r * per_round : (r + 1) * per_round]
        for i, a in enumerate(turn):
            out.append((a, r))
            if i < len(extra):
                out.append((extra[i], 0))
        out += [(s, 0) for s in extra[len(turn) :]]
    return out


async def _drive(ctx: Context, server: Server, client: httpx.AsyncClient, key: str) -> ServerResult:
    res = ServerResult(key)
    res.extra["budget_mib"] = ctx.sizes.mixed_budget / MiB
    ledger = ctx.ledger(f"{key}:mixed")
    by_kind = {k: {"requests": 0, "prompt": 0, "savable": 0, "saved": 0} for k in KINDS}
    actors, shots = _actors(ctx)
    background = await background_prefill(client, server)
    start = time.perf_counter()
    last = None
    for actor, step in schedule(actors, shots):
        req = actor.build(step)
        common = ledger.common(ctx.prompt_ids(req))
        reply = await send(client, server, req)
        actor.reply(reply)
        label = actor.name if actor.steps == 1 else f"{actor.name} #{step + 1}"
        res.samples.append(ctx.account(key, label, req, reply, group=actor.kind, ledger=ledger))
        row = by_kind[actor.kind]
        row["requests"] += 1
        row["prompt"] += reply.prompt_tokens or 0
        row["savable"] += common
        row["saved"] += reply.cached_tokens or 0
        last = (label, req, reply)
    res.wall_s = time.perf_counter() - start
    res.background_tokens = await background_prefill(client, server) - background
    res.extra["by_kind"] = by_kind
    total = {f: sum(r[f] for r in by_kind.values()) for f in ("prompt", "savable", "saved")}
    res.extra.update(total)
    res.extra["reports_cached"] = all(s.cached_tokens is not None for s in res.samples)
    res.extra["net_saved"] = total["saved"] - res.background_tokens
    if server.name == OURS:
        stats = (await client.get(server.url + "/v1/cache")).json().get("stats", {})
        res.extra["evictions"] = stats.get("evictions")
        # Entries the budget gave to the request extending them (cache/handover.py): the
        # budget biting too, without an eviction.
        res.extra["handed_over"] = stats.get("handed_over")
        res.extra["cache_mib"] = stats.get("bytes", 0) / MiB
    if last is not None:
        await ctx.check(client, server, res, *last)
    return res


def run_standalone(ctx: Context) -> dict[str, ServerResult]:
    budget = str(ctx.sizes.mixed_budget)
    path = ctx.model.path
    ours = ("--cache-budget", budget, "--cache-eviction")
    runs = {
        OURS: ServerSpec(OURS, path, (*ours, "value"), "ours-value"),
        OURS_KIND: ServerSpec(OURS, path, (*ours, "kind"), "ours-kind"),
        PEER: ServerSpec(PEER, path, ("--prompt-cache-bytes", budget), "peer-budget"),
    }
    out = {}
    for key, spec in runs.items():
        # One at a time: the same machine for each, and a fresh cache.
        server = Server(spec, ctx.out_dir / "logs").start()
        try:
            out[key] = run_async(lambda c, s=server, k=key: _drive(ctx, s, c, k))
        finally:
            server.stop()
    return out
