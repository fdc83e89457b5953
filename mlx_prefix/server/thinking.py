"""A reply's reasoning, split off its text: the part between the model's think markers
(`<think>` ... `</think>`) at the reply's start, for the API families that carry it
apart (Anthropic's `thinking` blocks). Text deltas in, (reasoning, text) out; a marker
cut across deltas is held back until it is whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_prefix.prompt.tool_calls import partial_suffix


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
    def of(cls, tokenizer: Any) -> ThinkSplitter | None:
        """For a tokenizer that knows its think markers; None otherwise."""
        if not getattr(tokenizer, "has_thinking", False):
            return None
        return cls(tokenizer.think_start, tokenizer.think_end)

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
