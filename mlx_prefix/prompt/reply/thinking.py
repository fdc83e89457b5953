"""A reply's reasoning, split off its text: the part between the model's think markers
(`<think>` ... `</think>`) at the reply's start, or, when the prompt left a think block
open (Qwen3.5's generation prompt ends with `<think>\n`), everything up to the end
marker. Every API family carries it apart (chat `reasoning_content`, Anthropic
`thinking` blocks, Responses `reasoning` items). Text deltas in, (reasoning, text) out;
a marker cut across deltas is held back until it is whole. The reasoning drops the edges
the template writes itself around reasoning sent back, where the model wrote them
(ReasoningEdges), so the client's copy renders back as the model wrote it. Pure: the
prefetch splits a whole reply with it too (prompt/reply.client_reply)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningEdges:
    """What a template writes itself around reasoning sent back: after the start marker
    (`lead`) and before the end marker (`trail`); Gemma 4: `<|channel>thought` `\\n` R
    `\\n` `<channel|>` (prompt/reply/reasoning.py reads them from a render). A reply's reasoning
    drops them where its model wrote them, else the next turn's prompt would hold them
    twice and stop reusing the cache there. Reasoning they would leave empty comes as
    written (Qwen3's `<think>\\n\\n</think>` renders back only with some)."""

    lead: str = ""
    trail: str = ""


NO_EDGES = ReasoningEdges()


@dataclass
class ThinkSplitter:
    """Reasoning at the reply's start, between the think markers, held apart from text."""

    start: str
    end: str
    edges: ReasoningEdges = NO_EDGES  # dropped from the reasoning where written
    _pending: str = ""
    _leading: bool = True  # at the reasoning's start: the lead may still come
    _dropped: str = ""  # the lead dropped
    _said: bool = False  # some reasoning handed out
    # opening (may still see the start marker) | thinking | closed (the end marker seen:
    # the newlines after it are dropped, however the deltas cut them) | done
    _state: str = "opening"

    @classmethod
    def of(
        cls, markers: tuple[str, str] | None, opened: bool = False, edges: ReasoningEdges = NO_EDGES
    ) -> ThinkSplitter | None:
        """For a model's think `markers` (start, end); None without. `opened`: the
        prompt left a think block open, so the reply starts inside it."""
        if markers is None:
            return None
        state = "thinking" if opened else "opening"
        return cls(markers[0], markers[1], edges, _state=state)

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
        lead, trail = self.edges.lead, self.edges.trail
        if self._state == "thinking" and self._leading and lead:
            if self._pending.startswith(lead):
                self._pending, self._leading = self._pending[len(lead) :], False
                self._dropped = lead
            elif lead.startswith(self._pending):
                return "", ""  # could still become the lead
            else:
                self._leading = False
        if self._state == "thinking":
            at = self._pending.find(self.end)
            if at < 0:
                # Held back: what may still become the end marker, or the trail and it.
                keep = partial_suffix(self._pending, self.end)
                keep = max(keep, partial_suffix(self._pending, trail + self.end) if trail else 0)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                self._said = self._said or bool(reasoning)
                return reasoning, ""
            reasoning, self._pending = self._pending[:at], self._pending[at + len(self.end) :]
            trimmed = reasoning.removesuffix(trail) if trail else reasoning
            reasoning = trimmed if trimmed or self._said else self._dropped + reasoning
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
            return (pending if self._said else self._dropped + pending), ""
        return "", pending


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
