"""The template's chunk grid: which tokens open a message, found once per model by
rendering small probe conversations (prompt/request/plan.py places checkpoints on it).

How close a boundary lands depends on the template's special tokens (detect_grid):
ChatML, Llama 3, Phi-3 and DeepSeek put one before every message's content, so every
message start is a grid point. Templates with none there (Mistral v1: `[INST]` is plain
text) cut after the end-of-turn token `</s>` instead, one point per exchange. Templates
that merge the system prompt into the first user turn as plain text (Gemma) have no
special token at the system end: SYSTEM falls back to the turn's start or a multiple of
the chunk size. Without any, every boundary falls back to multiples of the chunk size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mlx_prefix.conversation import Message, Role, ToolCall
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.request.grid import ChunkGrid
from mlx_prefix.prompt.request.render import SENTINEL, ChatRenderer, common_prefix_length

log = logging.getLogger("mlx_prefix.prompt")

# Conversations rendered once per model to find the template's segment tokens; the second
# is for templates that refuse a system message (Mistral, Gemma 1).
_PROBES: tuple[tuple[Role, ...], ...] = (
    ("system", "user", "assistant", "user"),
    ("user", "assistant", "user"),
)


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def _marker(i: int) -> str:
    return f"zqprobe{i}content"  # plain text no template rewrites, unique in the render


def _tokens_before_content(
    renderer: ChatRenderer, text: str, messages: list[Message], specials: set[int]
) -> set[int]:
    """The last special token before each marked message's content in `text`, the render
    of `messages` (the message-start token: `<|im_start|>`, `<|user|>`,
    `<|end_header_id|>`; `</s>` where a turn starts with plain text)."""
    found: set[int] = set()
    previous_end = 0
    for message in messages:
        marker = message.content
        if not marker or text.count(marker) != 1:
            continue
        start = text.index(marker)
        if start >= previous_end:
            gap = renderer.encode_chat(text[previous_end:start])
            last = next((t for t in reversed(gap) if t in specials), None)
            if last is not None:
                found.add(last)
        previous_end = max(previous_end, start + len(marker))
    return found


def detect_grid(renderer: ChatRenderer, chunk_size: int) -> ChunkGrid:
    """The template's chunk grid, from renders of small probe conversations.

    Segment tokens: for each role, the last special token before a message's content,
    one per message start. Taking only that one keeps chunks few (a grid point is a chunk
    boundary in every cold prefill: ChatML's `<|im_end|>` too would double them) and
    still puts every message start on the grid. The generation suffix is what the
    generation prompt appends; if none of its special tokens is a segment token, its
    first special token becomes one, so the history-end checkpoint is a grid point.
    """
    if not renderer.has_template:
        return ChunkGrid(chunk_size)
    specials = _special_ids(renderer.tokenizer)
    segment: set[int] = set()
    suffix: tuple[int, ...] = ()
    for roles in _PROBES:
        messages = [Message(r, _marker(i)) for i, r in enumerate(roles)]
        try:
            history = renderer.render_text(messages, add_generation_prompt=False)
            generation = renderer.render_text(messages, add_generation_prompt=True)
        except InvalidRequest:
            continue
        segment = _tokens_before_content(renderer, history, messages, specials)
        t_history, t_gen = renderer.encode_chat(history), renderer.encode_chat(generation)
        suffix = tuple(t_gen[common_prefix_length(t_history, t_gen) :])
        break
    tool_probe = [
        Message("user", _marker(0)),
        Message("assistant", tool_calls=(_CALL,)),
        Message("tool", _marker(2), tool_call_id="call_0", name="f"),
    ]
    try:
        text = renderer.render_text(tool_probe, add_generation_prompt=False)
        segment |= _tokens_before_content(renderer, text, tool_probe, specials)
    except InvalidRequest:
        pass  # no tool role in this template
    suffix_specials = [t for t in suffix if t in specials]
    if suffix_specials and not segment.intersection(suffix_specials):
        segment.add(suffix_specials[0])
    turn = _turn_start(renderer, specials)
    if not segment:
        log.warning(
            "the chat template puts no special token before a message: chat boundaries "
            "fall back to multiples of %d tokens, so hybrid models reuse less of a prompt",
            chunk_size,
        )
    return ChunkGrid(
        chunk_size, segment_tokens=frozenset(segment), generation_suffix=suffix, turn_start=turn
    )


# What precedes an assistant turn in the probes: the previous message's last characters,
# varied so that plain-text markup merging into them (`?<|` is one BPE piece) falls off
# the turn start, which keeps only what every context tokenizes alike.
_ENDINGS = ("zqprobe", "zqprobe?", "zqprobe.", 'zqprobe"}', "zqprobe)\n", "zqprobe ")
_CALL = ToolCall("f", {}, "call_0")
# How an assistant turn may render: with and without reasoning, a call, and as an earlier
# turn once a new question follows (templates drop or move reasoning there).
_REPLIES = (
    Message("assistant", SENTINEL),
    Message("assistant", "zqanswer", reasoning="zqthought"),
    Message("assistant", "", tool_calls=(_CALL,), reasoning="zqthought"),
)
_LATER = Message("user", "zqnext")


def _turn_start(renderer: ChatRenderer, specials: set[int]) -> tuple[tuple[int, ...], ...]:
    """The token runs that open an assistant turn, one per message it may follow (a user
    message, a tool result): the end of what a generation prompt and every probed
    history turn share, common to every ending of the message before. A run of plain
    text must be distinctive, so that it rarely occurs elsewhere."""
    leads = (
        lambda e: [Message("user", e)],
        lambda e: [
            Message("user", "zqask"),
            Message("assistant", tool_calls=(_CALL,)),
            Message("tool", e, tool_call_id="call_0", name="f"),
        ],
    )
    runs: list[tuple[int, ...]] = []
    for lead in leads:
        found = [_turn_head(renderer, lead(ending)) for ending in _ENDINGS]
        heads = [h for h in found if h is not None]
        if len(heads) < len(found):
            continue  # not a conversation this template accepts
        run = common_suffix(heads)
        if _distinctive(renderer, run, specials):
            runs.append(run)
    runs = list(dict.fromkeys(runs))
    # A run that ends another makes the longer one redundant.
    return tuple(r for r in runs if not any(o != r and r[len(r) - len(o) :] == o for o in runs))


def _distinctive(renderer: ChatRenderer, run: tuple[int, ...], specials: set[int]) -> bool:
    """Whether `run` rarely occurs but where a turn opens: it holds a special token, or
    at least 4 characters of plain text (Mistral's `INST`, whose `]` merges with what
    follows; GLM's `assistant|>`), never a `\n` alone that would cut at every line."""
    if any(t in specials for t in run):
        return True
    return len(renderer.tokenizer.decode(list(run)).strip()) >= 4


def _turn_head(renderer: ChatRenderer, before: list[Message]) -> tuple[int, ...] | None:
    """The tokens the generation prompt after `before` shares with every probed history
    turn there, or None if the template refuses `before`."""
    try:
        generation = renderer.encode_chat(renderer.render_text(before, add_generation_prompt=True))
    except InvalidRequest:
        return None
    shared = len(generation)
    for reply in _REPLIES:
        for after in ([], [_LATER]):
            try:
                text = renderer.render_text([*before, reply, *after], add_generation_prompt=False)
            except InvalidRequest:
                continue
            shared = min(shared, common_prefix_length(generation, renderer.encode_chat(text)))
    return tuple(generation[:shared])


def common_suffix(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    n = min(len(r) for r in runs)
    k = 0
    while k < n and len({r[len(r) - 1 - k] for r in runs}) == 1:
        k += 1
    return tuple(runs[0][len(runs[0]) - k :])
