"""What a verify forward of L rows per request costs against a plain decode step,
measured on the engine as it runs, and the draft length that pays most for it.

A verify of a draft of k tokens computes k+1 positions in one forward; a plain step
computes one. Where the device reads the weights once for all rows (a GPU at a small
batch) the k extra rows are nearly free; on a CPU each row's attention over a long
context and its share of the projections cost time of their own (SmolLM2 on a 2-core
CPU at 1,700 tokens of context: 9 rows about 2-3.5 steps, at 300 tokens 1.2-1.8). So
the ratio is measured here, never assumed: the seconds of plain steps and of verifies,
by the batch's request count, as medians of the latest few (the context grows as a reply
does; on a shared machine one timing in several is far off, and a mean would follow it),
priced per position past the first (PRIOR_ROW_COST steps before any verify is timed).

A draft whose tokens are each kept with probability `a` (given the ones before it kept:
a copy goes on or breaks) yields 1 + a + ... + a^k tokens for its verify; k pays when
that yield per step of cost beats a plain step's one token. Engine thread only.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PRIOR_ROW_COST = 0.25  # steps per drafted row, until a verify of the batch's size is timed
RECENT = 9  # the latest timings a cost is the median of
# A draft pays when its verify yields this much more per step than a plain step's one
# token: timings are noisy, and on a GPU a plain step may launch before the one ahead is
# read while a verify's tokens are read before the next step.
WORTH = 1.05


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify of k drafted tokens hands on, on average: its own draw, then each
    drafted token while every one before it was kept (1 + a + ... + a^k)."""
    return sum(acceptance**i for i in range(k + 1))


@dataclass(slots=True)
class VerifyCost:
    """Medians of the latest timings, by the batch's rows: a plain step's seconds, and a
    verify's cost per position past the first, in plain steps (the line through one row
    at one step).
    One slope for every width, so that any verify updates what every width is priced
    at: a width priced high once (a first, cold forward) would never run again to be
    measured anew."""

    _steps: dict[int, deque[float]] = field(default_factory=dict)
    _slopes: dict[int, deque[float]] = field(default_factory=dict)
    _step: dict[int, float] = field(default_factory=dict)  # the medians, kept current
    _slope: dict[int, float] = field(default_factory=dict)

    def stepped(self, rows: int, seconds: float) -> None:
        """A plain step of `rows` requests took `seconds` (computed and read)."""
        _record(self._steps, self._step, rows, seconds)

    def verified(self, rows: int, width: int, seconds: float) -> None:
        """A verify of `rows` requests, `width` positions each at most, took `seconds`
        (computed, drawn and handed on, as a plain step's tokens are)."""
        step = self._step.get(rows)
        if step and width > 1:
            slope = max(0.0, seconds / step - 1.0) / (width - 1)
            _record(self._slopes, self._slope, rows, slope)

    def ratio(self, rows: int, width: int) -> float:
        """A verify's cost in plain steps of the same batch."""
        return 1.0 + self._slope.get(rows, PRIOR_ROW_COST) * (width - 1)

    def longest_paying(self, acceptance: float, most: int, rows: int = 1) -> int:
        """The longest draft (up to `most`) whose verify yields over WORTH tokens per step
        of its cost; 0: none does."""
        for k in range(most, 0, -1):
            if expected_tokens(acceptance, k) / self.ratio(rows, k + 1) > WORTH:
                return k
        return 0

    def best_draft(self, acceptance: float, most: int, rows: int = 1) -> tuple[int, float]:
        """The draft length (0 to `most`) whose verify yields the most tokens per step
        of its cost, and that yield; 0 (a plain step, yield 1) when no draft yields
        WORTH or more."""
        best, value = 0, 1.0
        for k in range(1, most + 1):
            worth = expected_tokens(acceptance, k) / self.ratio(rows, k + 1)
            if worth > max(value, WORTH):
                best, value = k, worth
        return best, value


def _record(
    recent: dict[int, deque[float]], medians: dict[int, float], rows: int, value: float
) -> None:
    latest = recent.setdefault(rows, deque(maxlen=RECENT))
    latest.append(value)
    medians[rows] = statistics.median(latest)
