"""Next-turn prefetch: while the user reads a reply (or a tool runs), compute the
conversation up to where its next message will begin.

The post-generation state itself is never cached: decode computed the reply one token
at a time, and a cold prefill of the same tokens gives (slightly) different numbers,
so restoring it would let a cache hit change the answer. Instead, once the engine has
had nothing to do for a moment, the reply is prefilled again on the chunk grid, exactly
as a cold run of the next request would compute it, and checkpointed where the next
message begins. The next turn restores from there: its reuse reaches the whole
history, and the answer stays the cold run's.

Renders run on a helper thread (templates are slow for long chats), never on the
engine thread; the engine runs the resulting background jobs only when no request is
waiting, and drops one as soon as a request that cannot use it arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import DiskScope
from mlx_prefix.conversation import Conversation, Message
from mlx_prefix.engine.requests.chat_traffic import ChatTraffic
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.prompt.reply.reader import ReplyFormat, answer_text, client_reply, reply_reader
from mlx_prefix.prompt.reply.thinking import NO_EDGES, ReasoningEdges
from mlx_prefix.prompt.reply.tool_calls import ToolSyntax
from mlx_prefix.prompt.request.plan import Checkpoint, PromptPlanner, RenderedPrompt
from mlx_prefix.records import PromptInput, ToolCallIds

log = logging.getLogger("mlx_prefix.engine")

NEXT_MESSAGE = "?"  # stands for the next message; anything but the planner's sentinel


def wants_prefetch(source: PromptInput) -> bool:
    """Whether a finished request looks like one turn of a longer exchange whose next
    request we can render: a chat that already has a reply in its history, or offers
    tools. A one-shot request (a script, a browser extension's single instruction) never
    sends its reply back."""
    if source.messages is None:
        return False
    return bool(source.tools) or any(m.role == "assistant" for m in source.messages)


def next_turn_messages(
    source: PromptInput,
    reply: str,
    syntax: ToolSyntax | None,
    request_id: str,
    form: ReplyFormat | None = None,
    opened: bool = False,
    edges: ReasoningEdges = NO_EDGES,
) -> Conversation:
    """The conversation the client will send next: this one, the reply as the client
    received it, and a placeholder for the next message. A reply that calls tools comes
    back as an assistant message with structured calls, named as the server named them
    (every API shape becomes that message), followed by the first call's result; any
    other reply as its text, followed by a user message. A reply that continues the
    opening its prompt forced (a forced tool call) is read with that opening, as the
    server's assembler reads it. In the model's reply `form`, the reply is read as the
    server reads it (prompt/reply/reader.py; `opened`: the prompt left a think block open,
    `edges`: what its reasoning drops where written), its reasoning coming back as its
    `reasoning_content`, as the server answered it apart."""
    assert source.messages is not None
    ids = source.reply_tool_call_ids or ToolCallIds(request_id)
    if form is None:  # calls only, after the opening
        turn = client_reply(syntax, source.assistant_prefix + reply, source.tools, ids)
    else:
        calls = syntax if source.tools else None  # the server parses calls only then
        reader = reply_reader(
            form, calls, opened=opened, prefix=source.assistant_prefix, edges=edges
        )
        turn = client_reply(syntax, reply, source.tools, ids, reader)
    if turn.call_ids:
        nxt = Message("tool", NEXT_MESSAGE, tool_call_id=turn.call_ids[0])
    else:
        nxt = Message("user", NEXT_MESSAGE)
    return (*source.messages, turn.message, nxt)


def next_turn_prompt(
    planner: PromptPlanner,
    source: PromptInput,
    reply: str,
    computed: int,
    syntax: ToolSyntax | None = None,
    request_id: str = "",
    opens_reasoning: bool = False,
    form: ReplyFormat | None = None,
) -> RenderedPrompt | None:
    """The next request's prompt, cut where its last message begins, if that reaches past
    the `computed` tokens of this one; None otherwise. Does not touch MLX. `form`: the
    model's reply format, its engine's (None: read from the planner's tokenizer).

    The reply is rendered as the client will send it back (next_turn_messages), so
    templates that re-render earlier turns (Qwen3 strips <think> from them) render this
    reply the way the next request will; the planner finds where the next message
    begins (sentinel substitution) exactly as it will for the real next request.
    """
    form = form or ReplyFormat.of(planner.renderer.tokenizer)
    edges = planner.reply_edges(opens_reasoning)
    turn = next_turn_messages(source, reply, syntax, request_id, form, opens_reasoning, edges)
    probe = PromptInput(
        messages=turn,
        tools=source.tools,
        chat_template_kwargs=source.chat_template_kwargs,
    )
    rendered = planner.plan(probe)
    starts = [c.position for c in rendered.checkpoints if c.kind is CheckpointKind.LAST_MESSAGE]
    if not starts or max(starts) <= computed:
        return None
    end = max(starts)
    checkpoints = tuple(c for c in rendered.checkpoints if c.position < end)
    return RenderedPrompt(
        rendered.tokens[:end], (*checkpoints, Checkpoint(end, CheckpointKind.HISTORY)), True
    )


@dataclass(frozen=True, slots=True)
class NextTurn:
    """A finished request whose next turn is prefetched: its prompt, its reply."""

    source: PromptInput
    reply: str
    computed: int  # its prompt's tokens: a prefetch is worth it only past them
    request_id: str  # names the reply's tool calls as the server named them
    key: str  # the cache entry key the prefetch stores under
    scope: DiskScope | None = None
    opens_reasoning: bool = False  # its prompt left a think block open: the reply reasons


class Prefetcher:
    """Renders next-turn prompts off the engine thread and hands them to `enqueue`,
    with the entry key (namespace) and disk scope of the request they follow: a prefetch
    stores its checkpoints where only that client's next turn can find them, and writes
    to disk only what that request allowed."""

    def __init__(
        self,
        planner: PromptPlanner,
        form: ReplyFormat,
        enqueue: Callable[[RenderedPrompt, str, DiskScope | None], None],
    ):
        self.planner = planner
        self.form = form  # the model's reply format, as the server reads replies
        self.enqueue = enqueue
        self.chat_traffic = ChatTraffic()  # engine thread only
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-prefix-prefetch")

    def after_reply(self, job: Job, reply: str) -> None:
        """A request ended with `reply` (engine thread): prefetch its next turn if its
        client will send one."""
        if job.source is None or not job.cache_pref.enabled:
            return
        # A chat's first turn, known from its client's earlier traffic in the same
        # namespace (chat_traffic.py); later turns and tool-call turns from the request.
        # The reply as its client sees it and sends it back: without its reasoning.
        shown = answer_text(self.form, reply, job.prompt.opens_reasoning)
        first_turn = self.chat_traffic.finished(job.source, shown, job.cache_key)
        if first_turn or wants_prefetch(job.source):
            self.submit(
                NextTurn(
                    job.source,
                    reply,
                    computed=len(job.tokens),
                    request_id=job.handle.request_id,
                    key=job.cache_key,
                    # Its disk scope: "off" writes nothing, prefetch too.
                    scope=job.cache_pref.scope,
                    opens_reasoning=job.prompt.opens_reasoning,
                )
            )

    def submit(self, turn: NextTurn) -> None:
        """Render `turn`'s next prompt on the helper thread, and enqueue it."""
        try:
            self._pool.submit(self._render, turn)
        except RuntimeError:  # closed: the engine is shutting down
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _render(self, turn: NextTurn) -> None:
        try:
            prompt = next_turn_prompt(
                self.planner,
                turn.source,
                turn.reply,
                turn.computed,
                self.form.tools,
                turn.request_id,
                turn.opens_reasoning,
                form=self.form,
            )
        except Exception:  # a template that cannot render it: nothing to prefetch
            log.debug("next-turn render failed", exc_info=True)
            return
        if prompt is not None:
            self.enqueue(prompt, turn.key, turn.scope)
