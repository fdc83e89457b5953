"""A reply's reasoning, split off its text: the part between the model's think markers
(`<think>` ... `</think>`) at the reply's start, or, when the prompt left a think block
open (Qwen3.5's generation prompt ends with `<think>\n`), everything up to the end
marker. Every API family carries it apart (chat `reasoning_content`, Anthropic
`thinking` blocks, Responses `reasoning` items). Text deltas in, (reasoning, text) out;
a marker cut across deltas is held back until it is whole. Pure: the prefetch splits a
whole reply with it too (prompt/reply.client_reply)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ThinkSplitter:
    """Reasoning at the reply's start, between the think markers, held apart from text."""

    start: str
    end: str
    _pending: str = ""
    # opening (may still see the start marker) | thinking | closed (the end marker seen:
    # the newlines after it are dropped, however the deltas cut them) | done
    _state: str = "opening"

    @classmethod
    def of(cls, tokenizer: Any, opened: bool = False) -> ThinkSplitter | None:
        """For a tokenizer that knows its think markers; None otherwise. `opened`: the
        prompt left a think block open, so the reply starts inside it."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        return cls(
            tokenizer.think_start, tokenizer.think_end, _state="thinking" if opened else "opening"
        )

    @property
    def reasoning(self) -> bool:
        """Inside the reasoning block now."""
        return self._state == "thinking"

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, text) safe to hand out now."""
        self._pending += text
        if self._state == "opening":
            stripped = self._pending.lstrip()
            if stripped.startswith(self.start):
                self._pending, self._state = stripped[len(self.start) :], "thinking"
            elif self.start.startswith(stripped):
                return "", ""  # could still become the start marker
            else:
                self._state = "done"
        reasoning = ""
        if self._state == "thinking":
            at = self._pending.find(self.end)
            if at < 0:
                keep = partial_suffix(self._pending, self.end)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return reasoning, ""
            reasoning, self._pending = self._pending[:at], self._pending[at + len(self.end) :]
            self._state = "closed"
        if self._state == "closed":
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return reasoning, ""
            self._state = "done"
        text, self._pending = self._pending, ""
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        if self._state == "thinking":
            return pending, ""
        return "", pending


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
