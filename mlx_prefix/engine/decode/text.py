"""Detokenized text deltas with stop strings held back until they can't match."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class _Automaton:
    """Aho-Corasick tables over a set of stop strings; read-only once built."""

    goto: list[dict[str, int]]  # node -> character -> node (the trie of the strings)
    depth: list[int]  # node -> characters from the root
    fail: list[int]  # node -> the node of its longest proper suffix in the trie
    out: list[str | None]  # node -> the longest stop string ending there


# Clients send the same few stop lists again and again; building one costs time linear in
# its characters (MAX_STOP_CHARS each, server/protocol/request.py) on the engine thread.
@functools.lru_cache(maxsize=8)
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    goto: list[dict[str, int]] = [{}]
    depth = [0]
    word: list[str | None] = [None]  # the stop string ending at this node
    for s in stops:
        node = 0
        for ch in s:
            nxt = goto[node].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[node][ch] = nxt
                goto.append({})
                depth.append(depth[node] + 1)
                word.append(None)
            node = nxt
        word[node] = s
    fail = [0] * len(goto)
    out = list(word)  # then inherited along failure links
    frontier = list(goto[0].values())
    while frontier:  # breadth first: a failure link points to a shallower node
        deeper = []
        for node in frontier:
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
                if out[child] is None:
                    out[child] = out[fail[child]]
                deeper.append(child)
        frontier = deeper
    return _Automaton(goto, depth, fail, out)


class StopMatcher:
    """An Aho-Corasick automaton over the stop strings, fed one character at a time.

    Each character costs amortised O(1) steps whatever the stop strings' count and
    length (a failure step shortens the matched suffix, a character lengthens it by at
    most one), so a reply costs time linear in its length. `held` is the length of the
    longest tail of the text that is the start of some stop string: what must be held
    back."""

    def __init__(self, stops: Sequence[str]):
        self._a = _automaton(tuple(stops))
        self._state = 0
        self.steps = 0  # transitions taken, failure steps included (tests bound the work)

    def feed(self, ch: str) -> str | None:
        """Advance by one character; the stop string that now ends the text (the longest
        if several do), or None. Mutates the matcher's state (never the shared tables)."""
        a, state = self._a, self._state
        while state and ch not in a.goto[state]:
            state = a.fail[state]
            self.steps += 1
        self.steps += 1
        state = a.goto[state].get(ch, 0)
        self._state = state
        return a.out[state]

    @property
    def held(self) -> int:
        return self._a.depth[self._state]


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
