"""Detokenized text deltas with stop strings held back until they can't match."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Turns tokens into text deltas. A tail that could be the start of a stop string is
    held back, so a stop string never reaches the client, even split across tokens."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop = tuple(s for s in stop if s)
        self._text = ""  # all text so far
        self._sent = 0  # characters handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, token: int) -> str:
        """Add a token; return the new text that is safe to send ('' if none)."""
        self.detokenizer.add_token(token)
        self._text += self.detokenizer.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        """Flush what is left (after the last token)."""
        if not self.stopped:
            self.detokenizer.finalize()
            self._text += self.detokenizer.last_segment
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        for s in self.stop:
            at = self._text.find(s, max(0, self._sent - len(s) + 1))
            if at != -1:  # a later, earlier-starting match cuts further: it wins
                self._text = self._text[:at]
                self.stopped = True
                self.matched = s
                final = True
        end = len(self._text)
        if not final and self.stop:
            for s in self.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self._text.endswith(s[:k]):
                        end = min(end, len(self._text) - k)
                        break
        end = max(end, self._sent)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    @property
    def text(self) -> str:
        return self._text
