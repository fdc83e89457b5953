"""A model's reasoning markers as its tokenizer and chat template write them.

mlx-lm's tokenizer wrapper knows a thinking model's markers (`think_start` /
`think_end`, one token or several: `<think>`, `<|channel>thought`); gpt-oss's are its
harmony analysis message (`<|channel|>analysis<|message|>` ... `<|end|>`, whose close
before the answer is harmony's, prompt/reply/harmony.py). Two facts follow
from a prompt's tokens and the template:
- whether the prompt leaves a think block open (Qwen3.5 and Nemotron 3 Nano end their
  generation prompt with `<think>\\n`): then the reply starts as reasoning, as
  mlx_lm.server decides with `rfind_think_start` / `rfind_think_end`;
- how the template closes a reasoning block before the answer (Qwen3.5:
  `\\n</think>\\n\\n`; Gemma 4: `\\n<channel|>`), read from a render of a reply with
  sentinel reasoning and content (and a call: Gemma 4 renders reasoning only then):
  what the server forces when a reasoning budget runs out, and what a forced tool
  call's opening starts with after an open think block;
- what the template writes itself around reasoning sent back (its edges: `\\n` after
  Gemma 4's `<|channel>thought`, Qwen's and MiniMax's `<think>`, and `\\n` before the
  end marker), read from the same render: a reply that writes them hands its reasoning
  out without them (prompt/reply/thinking.py), so the client's copy renders back as the model
  wrote it and the next turn reuses the cache past the reasoning.
Built once per model (prompt/request/plan.PromptPlanner); pure, no MLX.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_prefix.conversation import Message, ToolCall
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.reply import harmony
from mlx_prefix.prompt.reply.thinking import NO_EDGES, ReasoningEdges

log = logging.getLogger("mlx_prefix.prompt")

_REASONING, _ANSWER = "zqreasoningprobe", "zqanswerprobe"  # plain text no template rewrites
_QUESTION = Message("user", "zqquestionprobe")
_PROBES = (
    Message("assistant", _ANSWER, reasoning=_REASONING),
    Message("assistant", _ANSWER, reasoning=_REASONING, tool_calls=(ToolCall("f", {}, "c0"),)),
)


class ChatRenderer(Protocol):
    """What the markers are read with: the template's renderer (prompt/request/render.py)."""

    tokenizer: Any

    def render_text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The template's text for `messages` (InvalidRequest where it refuses them)."""
        ...

    def encode_chat(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ReasoningMarkers:
    start_text: str
    end_text: str
    start: tuple[int, ...]  # the start marker's token ids
    end: tuple[int, ...]
    close_text: str  # what the template writes between a turn's reasoning and its answer
    close: tuple[int, ...]  # close_text's tokens
    # What the template writes itself around reasoning sent back (whitespace only), and
    # the part of it left to the model after a generation prompt that opens the block
    # (Qwen3.5's `<think>\\n` writes the lead).
    edges: ReasoningEdges = NO_EDGES
    opened_edges: ReasoningEdges = NO_EDGES

    @classmethod
    def of(cls, renderer: ChatRenderer) -> ReasoningMarkers | None:
        """For a tokenizer that knows its think markers (or a harmony model); None
        otherwise."""
        tokenizer = renderer.tokenizer
        edges = opened = NO_EDGES  # harmony's analysis message comes back as written
        if harmony.Harmony.of(tokenizer) is not None:
            start_text, end_text, close_text = harmony.ANALYSIS, harmony.END, harmony.CLOSE
        elif getattr(tokenizer, "has_thinking", False):
            start_text, end_text = tokenizer.think_start, tokenizer.think_end
            close_text = ""
        else:
            return None
        start, end = renderer.encode_chat(start_text), renderer.encode_chat(end_text)
        if not start or not end:
            return None
        if not close_text:
            renders = _probe_renders(renderer)
            close_text = _template_close(renders, end_text)
            lead = _template_lead(renders, start_text)
            trail = _template_trail(renders, end_text)
            edges = ReasoningEdges(lead, trail)
            opened = ReasoningEdges(_opened_lead(renderer, start_text, end_text, lead), trail)
        return cls(
            start_text,
            end_text,
            tuple(start),
            tuple(end),
            close_text,
            tuple(renderer.encode_chat(close_text)),
            edges,
            opened,
        )

    def reply_edges(self, opened: bool) -> ReasoningEdges:
        """The edges a reply's reasoning drops where its model wrote them; `opened`: the
        prompt left the block open, the reply starts inside it."""
        return self.opened_edges if opened else self.edges

    def opens(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` leave a think block open: a start marker after the last end
        marker."""
        first_start, first_end = self.start[0], self.end[0]
        for i in range(len(tokens) - 1, -1, -1):
            token = tokens[i]
            if token == first_start and _at(tokens, i, self.start):
                return True
            if token == first_end and _at(tokens, i, self.end):
                return False
        return False

    def opens_text(self, text: str) -> bool:
        """`opens` on text (a prompt before it is tokenized)."""
        return text.rfind(self.start_text) > text.rfind(self.end_text)


def _at(tokens: Sequence[int], i: int, marker: tuple[int, ...]) -> bool:
    return tuple(tokens[i : i + len(marker)]) == marker


def _probe_renders(renderer: ChatRenderer) -> list[tuple[Message, str, int]]:
    """Each probe turn the template renders with its reasoning and answer: (the turn,
    its render after the question, where the reasoning starts)."""
    found = []
    for reply in _PROBES:
        try:
            text = renderer.render_text([_QUESTION, reply], add_generation_prompt=False)
        except InvalidRequest:
            continue
        at = text.find(_REASONING)
        if at >= 0 and text.find(_ANSWER, at + len(_REASONING)) >= 0:
            found.append((reply, text, at))
    return found


def _template_close(renders: list[tuple[Message, str, int]], end_text: str) -> str:
    """What an assistant turn's render writes after its reasoning: up to its answer
    (Qwen3.5: `\\n</think>\\n\\n`; harmony's end and final header), or where a call
    follows the reasoning (Gemma 4 renders reasoning only on a turn with calls), up to
    the end marker and the whitespace after it (Gemma 4: `\\n<channel|>`). Qwen's and
    DeepSeek's `\\n</think>\\n\\n` when the template renders no reasoning (or refuses
    the probes)."""
    for reply, text, at in renders:
        after = at + len(_REASONING)
        between = text[after : text.find(_ANSWER, after)]
        if end_text not in between:
            continue
        if not reply.tool_calls:
            return between
        end = between.index(end_text) + len(end_text)
        rest = between[end:]
        return between[:end] + rest[: len(rest) - len(rest.lstrip())]
    fallback = f"\n{end_text}\n\n"
    log.debug("the template writes no %r after reasoning; using %r", end_text, fallback)
    return fallback


def _template_lead(renders: list[tuple[Message, str, int]], start_text: str) -> str:
    """What the template writes between the start marker and a turn's reasoning (Gemma
    4's, Qwen's, MiniMax's `\\n`; GLM's nothing): whitespace only, or nothing (text
    there is not a separator a model's reply can be said to repeat)."""
    for _, text, at in renders:
        start = text.rfind(start_text, 0, at)
        if start < 0:
            continue
        lead = text[start + len(start_text) : at]
        if lead.strip():
            log.debug("the template writes %r before reasoning; dropping none", lead)
            return ""
        return lead
    return ""


def _template_trail(renders: list[tuple[Message, str, int]], end_text: str) -> str:
    """What the template writes between a turn's reasoning and the end marker (Gemma
    4's, Nemotron's, MiniMax's `\\n`): whitespace only, or nothing."""
    for _, text, at in renders:
        after = at + len(_REASONING)
        end = text.find(end_text, after)
        if end >= 0 and end < text.find(_ANSWER, after):
            trail = text[after:end]
            return "" if trail.strip() else trail
    return ""


def _opened_lead(renderer: ChatRenderer, start_text: str, end_text: str, lead: str) -> str:
    """The part of `lead` a generation prompt that opens the block leaves to the model:
    none after Qwen3.5's, Nemotron's, MiniMax's `<think>\\n`; all of it where the
    default generation prompt opens no block (its kwargs may)."""
    if not lead:
        return ""
    try:
        text = renderer.render_text([_QUESTION], add_generation_prompt=True)
    except InvalidRequest:
        return lead
    start = text.rfind(start_text)
    if start < 0 or text.rfind(end_text) > start:
        return lead
    written = text[start + len(start_text) :]
    return lead[len(written) :] if lead.startswith(written) else ""
