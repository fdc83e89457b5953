"""Token positions of a client's cache breakpoints (Anthropic's `cache_control`).

A breakpoint marks the end of the prefix a client will send again unchanged: the end of
a tool definition, of a message, or of a system block inside the system message. Its
position is found like a message start (plan.py): render the prompt again
with what follows the breakpoint replaced by a sentinel; the common token prefix of the
two renders ends at or just before the breakpoint. The planner then aligns it down onto
the chunk grid, so a breakpoint at a message's end lands just after the next message's
start token, where a cold prefill of the same prefix also ends a chunk.

Pure: renders and tokenizes, no MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mlx_prefix.prompt.request.render import SENTINEL as MARK
from mlx_prefix.prompt.request.render import ChatRenderer, common_prefix_length
from mlx_prefix.records import Breakpoint, PromptInput

_SENTINEL_TOOL = {"type": "function", "function": {"name": MARK, "parameters": {}}}


def breakpoint_positions(
    renderer: ChatRenderer,
    prompt: PromptInput,
    tokens: Sequence[int],
    message_start: Callable[[int], int],
) -> list[int]:
    """Unaligned positions where each of `prompt.breakpoints` ends, in `tokens` (the
    render of `prompt`). `message_start(i)` is where messages[i]'s
    content begins (the planner's memoized sentinel render). Out-of-range breakpoints
    are skipped: the protocol layer validated them."""
    positions = set()
    for bp in prompt.breakpoints:
        position = _position(renderer, prompt, tokens, message_start, bp)
        if position is not None and position > 0:
            positions.add(position)
    return sorted(positions)


def _position(
    renderer: ChatRenderer,
    prompt: PromptInput,
    tokens: Sequence[int],
    message_start: Callable[[int], int],
    bp: Breakpoint,
) -> int | None:
    messages = prompt.messages or ()
    if bp.tool is not None:
        tools = prompt.tools or ()
        if not 0 <= bp.tool < len(tools):
            return None
        return _differs_at(renderer, prompt, tokens, tools=(*tools[: bp.tool + 1], _SENTINEL_TOOL))
    if bp.message is None or not 0 <= bp.message < len(messages):
        return None
    content = messages[bp.message].content
    if bp.chars is not None and bp.chars < len(content):
        contents = {bp.message: content[: bp.chars] + MARK}
        return _differs_at(renderer, prompt, tokens, tools=prompt.tools, contents=contents)
    if bp.message + 1 < len(messages):
        return message_start(bp.message + 1)
    return len(tokens)  # the last message: up to the generation prompt (aligned down)


def _differs_at(
    renderer: ChatRenderer,
    prompt: PromptInput,
    tokens: Sequence[int],
    tools: Sequence[dict[str, Any]] | None,
    contents: Mapping[int, str] | None = None,
) -> int:
    text = renderer.render_text(
        prompt.messages or (),
        tools=tools,
        template_kwargs=prompt.chat_template_kwargs,
        contents=contents,
    )
    return common_prefix_length(tokens, renderer.encode_chat(text + prompt.assistant_prefix))
