"""A model's reasoning markers as its tokenizer and chat template write them.

mlx-lm's tokenizer wrapper knows a thinking model's markers (`think_start` /
`think_end`, one token or several: `<think>`, `<|channel>thought`); gpt-oss's are its
harmony analysis message (`<|channel|>analysis<|message|>` ... `<|end|>`, whose close
before the answer is harmony's, prompt/harmony.py). Two facts follow
from a prompt's tokens and the template:
- whether the prompt leaves a think block open (Qwen3.5 and Nemotron 3 Nano end their
  generation prompt with `<think>\\n`): then the reply starts as reasoning, as
  mlx_lm.server decides with `rfind_think_start` / `rfind_think_end`;
- how the template closes a reasoning block before the answer (Qwen3.5:
  `\\n</think>\\n\\n`; Gemma 4: `\\n<channel|>`), read from a render of a reply with
  sentinel reasoning and content (and a call: Gemma 4 renders reasoning only then):
  what the server forces when a reasoning budget runs out, and what a forced tool
  call's opening starts with after an open think block.
Built once per model (prompt/boundaries.PromptPlanner); pure, no MLX.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from mlx_prefix.conversation import Message, ToolCall
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt import harmony
from mlx_prefix.prompt.render import ChatRenderer

log = logging.getLogger("mlx_prefix.prompt")

_REASONING, _ANSWER = "zqreasoningprobe", "zqanswerprobe"  # plain text no template rewrites
_QUESTION = Message("user", "zqquestionprobe")
_PROBES = (
    Message("assistant", _ANSWER, reasoning=_REASONING),
    Message("assistant", _ANSWER, reasoning=_REASONING, tool_calls=(ToolCall("f", {}, "c0"),)),
)


@dataclass(frozen=True)
class ReasoningMarkers:
    start_text: str
    end_text: str
    start: tuple[int, ...]  # the start marker's token ids
    end: tuple[int, ...]
    close_text: str  # what the template writes between a turn's reasoning and its answer
    close: tuple[int, ...]  # close_text's tokens

    @classmethod
    def of(cls, renderer: ChatRenderer) -> ReasoningMarkers | None:
        """For a tokenizer that knows its think markers (or a harmony model); None
        otherwise."""
        tokenizer = renderer.tokenizer
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
        close_text = close_text or _template_close(renderer, end_text)
        return cls(
            start_text,
            end_text,
            tuple(start),
            tuple(end),
            close_text,
            tuple(renderer.encode_chat(close_text)),
        )

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


def _template_close(renderer: ChatRenderer, end_text: str) -> str:
    """What an assistant turn's render writes after its reasoning: up to its answer
    (Qwen3.5: `\\n</think>\\n\\n`; harmony's end and final header), or where a call
    follows the reasoning (Gemma 4 renders reasoning only on a turn with calls), up to
    the end marker and the whitespace after it (Gemma 4: `\\n<channel|>`). Qwen's and
    DeepSeek's `\\n</think>\\n\\n` when the template renders no reasoning (or refuses
    the probes)."""
    for reply in _PROBES:
        try:
            text = renderer.render_text([_QUESTION, reply], add_generation_prompt=False)
        except InvalidRequest:
            continue
        at = text.find(_REASONING)
        answer = text.find(_ANSWER, at + len(_REASONING))
        if at < 0 or answer < 0:
            continue
        between = text[at + len(_REASONING) : answer]
        if end_text not in between:
            continue
        if not reply.tool_calls:
            return between
        end = between.index(end_text) + len(end_text)
        after = between[end:]
        return between[:end] + after[: len(after) - len(after.lstrip())]
    fallback = f"\n{end_text}\n\n"
    log.debug("the template writes no %r after reasoning; using %r", end_text, fallback)
    return fallback
