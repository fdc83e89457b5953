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

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.prompt.boundaries import Checkpoint, PromptPlanner, RenderedPrompt
from mlx_prefix.records import PromptInput

log = logging.getLogger("mlx_prefix.engine")

NEXT_MESSAGE = "?"  # stands for the next message; anything but the planner's sentinel


def wants_prefetch(source: PromptInput, reply: str, tool_call_start: str | None) -> bool:
    """Whether a finished request looks like one turn of a longer exchange whose next
    request we can render: a chat that already has a reply in its history, or offers
    tools. A one-shot request (a script, a browser extension's single instruction) never
    sends its reply back, and a reply that calls a tool comes back as structured
    `tool_calls` that the template renders its own way, not as the text we produced."""
    if source.messages is None or (tool_call_start and tool_call_start in reply):
        return False
    if source.assistant_prefix:  # the reply continues a forced tool call: a call too
        return False
    return bool(source.tools) or any(m.get("role") == "assistant" for m in source.messages)


def next_turn_prompt(
    planner: PromptPlanner, source: PromptInput, reply: str, computed: int
) -> RenderedPrompt | None:
    """The next request's prompt, cut where its last message begins, if that reaches past
    the `computed` tokens of this one; None otherwise. Does not touch MLX.

    The reply is rendered as the client will send it back (an assistant message with the
    text it received) followed by a placeholder user message, so templates that
    re-render earlier turns (Qwen3 strips <think> from them) render this reply the way
    the next request will; the planner finds where that message begins (sentinel
    substitution) exactly as it will for the real next request.
    """
    assert source.messages is not None
    probe = PromptInput(
        messages=(
            *source.messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": NEXT_MESSAGE},
        ),
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


class Prefetcher:
    """Renders next-turn prompts off the engine thread and hands them to `enqueue`."""

    def __init__(self, planner: PromptPlanner, enqueue: Callable[[RenderedPrompt], None]):
        self.planner = planner
        self.enqueue = enqueue
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-prefix-prefetch")

    def submit(self, source: PromptInput, reply: str, computed: int) -> None:
        try:
            self._pool.submit(self._render, source, reply, computed)
        except RuntimeError:  # closed: the engine is shutting down
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _render(self, source: PromptInput, reply: str, computed: int) -> None:
        try:
            prompt = next_turn_prompt(self.planner, source, reply, computed)
        except Exception:  # a template that cannot render it: nothing to prefetch
            log.debug("next-turn render failed", exc_info=True)
            return
        if prompt is not None:
            self.enqueue(prompt)
