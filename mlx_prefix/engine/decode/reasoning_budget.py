"""A reasoning budget (SamplingParams.reasoning_budget): once a reply has reasoned that
many tokens inside its think block, the block is closed the way the chat template
closes one (prompt/reply/reasoning.py: Qwen3.5's `\\n</think>\\n\\n`) by forcing those tokens
through the request's sampler, and the model goes on to answer.

The block is the one the prompt left open, or one the reply opens with its first
tokens (Qwen3's template lets the model write `<think>` itself); reasoning later in a
reply is not bounded (the server splits only leading reasoning off either). A model
without think markers has no reasoning to bound. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.prompt.reply.reasoning import ReasoningMarkers


@dataclass(slots=True)
class ReasoningBudget:
    markers: ReasoningMarkers
    budget: int
    sampler: TokenSampler  # the request's: the close is forced through it
    state: str  # opening (the reply may still open a block) | reasoning | done
    spent: int = 0  # reasoning tokens so far
    seen: int = 0  # reply tokens so far
    _recent: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        budget: int | None,
        markers: ReasoningMarkers | None,
        opened: bool,
        sampler: TokenSampler,
    ) -> ReasoningBudget | None:
        """The bound of one request (None: no budget, or a model without markers). With
        a budget of 0 and the prompt's block open, the reply's first tokens are the close."""
        if budget is None or markers is None:
            return None
        bound = cls(markers, budget, sampler, "reasoning" if opened else "opening")
        if opened and budget <= 0:
            bound._close()
        return bound

    def after(self, token: int) -> None:
        """The reply went on with `token` (sampled or forced)."""
        self.seen += 1
        self._recent = [*self._recent, token][
            -max(len(self.markers.start), len(self.markers.end)) :
        ]
        if self.state == "opening":
            if self._ends_with(self.markers.start):
                self.state = "reasoning"
                if self.budget <= 0:
                    self._close()
            elif self.seen >= len(self.markers.start):
                self.state = "done"  # the reply did not open with reasoning
        elif self.state == "reasoning":
            if self._ends_with(self.markers.end):
                self.state = "done"
                return
            self.spent += 1
            if self.spent >= self.budget:
                self._close()

    @property
    def bounding(self) -> bool:
        """The reply may still reason or is being closed: every token goes through the
        sampler one at a time (no speculative decoding)."""
        return self.state != "done" or self.sampler.forcing

    def _close(self) -> None:
        self.state = "done"
        self.sampler.force(self.markers.close)

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return tuple(self._recent[-len(marker) :]) == marker
