"""Detokenized text deltas with stop strings held back until they can't match."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopMatcher:
    """An Aho-Corasick automaton over the stop strings, fed one character at a time.

    Each character costs amortised O(1) steps whatever the stop strings' count and
    length (a failure step shortens the matched suffix, a character lengthens it by at
    most one), so a reply costs time linear in its length. `held` is the length of the
    longest tail of the text that is the start of some stop string: what must be held
    back."""

    def __init__(self, stops: Sequence[str]):
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._word: list[str | None] = [None]  # the stop string ending at this node
        for s in stops:
            node = 0
            for ch in s:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._word.append(None)
                node = nxt
            self._word[node] = s
        self._fail = [0] * len(self._goto)
        # A node's output: the longest stop string ending there (itself or via failure links).
        self._out = list(self._word)
        frontier = list(self._goto[0].values())
        while frontier:  # breadth first: a failure link points to a shallower node
            nxt_frontier = []
            for node in frontier:
                for ch, child in self._goto[node].items():
                    f = self._fail[node]
                    while f and ch not in self._goto[f]:
                        f = self._fail[f]
                    target = self._goto[f].get(ch, 0)
                    self._fail[child] = target if target != child else 0
                    if self._out[child] is None:
                        self._out[child] = self._out[self._fail[child]]
                    nxt_frontier.append(child)
            frontier = nxt_frontier
        self._state = 0
        self.steps = 0  # transitions taken, failure steps included (tests bound the work)

    def feed(self, ch: str) -> str | None:
        """Advance by one character; the stop string that now ends the text (the longest
        if several do), or None. Mutates the automaton's state."""
        state = self._state
        while state and ch not in self._goto[state]:
            state = self._fail[state]
            self.steps += 1
        self.steps += 1
        state = self._goto[state].get(ch, 0)
        self._state = state
        return self._out[state]

    @property
    def held(self) -> int:
        return self._depth[self._state]


class TextStream:
    """Turns tokens into text deltas. A tail that could be the start of a stop string is
    held back, so a stop string never reaches the client, even split across tokens. The
    first stop string to end in the text wins (the longest of those ending together),
    whatever the token boundaries; the text is cut where it starts."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop = tuple(s for s in stop if s)
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._sent: list[str] = []  # deltas handed out
        self._pending = ""  # text not handed out yet: the held-back tail and the new segment
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, token: int) -> str:
        """Add a token; return the new text that is safe to send ('' if none)."""
        self.detokenizer.add_token(token)
        return self._release(self.detokenizer.last_segment, final=False)

    def finish(self) -> str:
        """Flush what is left (after the last token)."""
        if self.stopped:
            return ""
        self.detokenizer.finalize()
        return self._release(self.detokenizer.last_segment, final=True)

    def _release(self, segment: str, final: bool) -> str:
        if self.stopped:
            return ""
        start = len(self._pending)
        self._pending += segment
        held = 0
        if self._matcher is not None:
            for i in range(start, len(self._pending)):
                match = self._matcher.feed(self._pending[i])
                if match is not None:
                    # A match starts inside the held-back tail or later: never in sent text.
                    self._pending = self._pending[: i + 1 - len(match)]
                    self.stopped, self.matched, final = True, match, True
                    break
            held = self._matcher.held
        end = len(self._pending) if final else len(self._pending) - held
        delta, self._pending = self._pending[:end], self._pending[end:]
        if delta:
            self._sent.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._sent) + self._pending
