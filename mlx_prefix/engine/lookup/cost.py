"""What a verify forward of several drafted tokens costs against a plain decode step,
measured on the engine as it runs, and the draft length that pays most for it.

A verify computes each request's input and its drafted tokens in one forward; a plain
step computes the input alone. Where the device reads the weights once for all rows (a
GPU at a small batch) the extra positions are nearly free; on a CPU each one's attention
over a long context and its share of the projections cost time of their own (SmolLM2 on
a 2-core CPU at 2,000 tokens of context, 4 requests: about 0.06-0.08 of their step a
drafted token, after some 0.3 steps for any verify at all). A shorter row's padding is
not computed (engine/forward/verify_positions.py), so a verify costs by the tokens
drafted in all, not by its widest row. So the cost is measured here, never assumed: the
seconds of plain steps and of verifies, by the batch's request count, as the line
through the latest few (drafted tokens, steps past one) that a far-off timing on a shared
machine does not move (medians), PRIOR_TOKEN_COST steps a token before any is timed.

A draft whose tokens are each kept with probability `a` (given the ones before it kept:
a copy goes on or breaks) yields 1 + a + ... + a^k tokens for its verify; k pays when
that yield beats a plain step's one token per step of the request's own share of the
cost: in a batch of n a step's time is n requests' one token each, and a verify where it
alone drafts k costs its overhead and k tokens over that. Engine thread only.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import NamedTuple

PRIOR_TOKEN_COST = 0.25  # a lone request's steps a drafted token, until a verify is timed
RECENT = 9  # the latest timings a cost is taken from
# Verifies of a batch size at most before a plain step of it is timed again: a step's
# time grows with the context (its attention over every key), so a verify priced in a
# step timed long before (verifies running back to back) would be priced high.
RESTEP = 32
# A draft pays when its verify yields this much more per step than a plain step's one
# token: timings are noisy, and on a GPU a plain step may launch before the one ahead is
# read while a verify's tokens are read before the next step.
WORTH = 1.05


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify of k drafted tokens hands on, on average: its own draw, then each
    drafted token while every one before it was kept (1 + a + ... + a^k)."""
    return sum(acceptance**i for i in range(k + 1))


class Line(NamedTuple):
    """A verify's steps past one plain step: `overhead` + `per_token` x tokens drafted."""

    overhead: float
    per_token: float


@dataclass(slots=True)
class VerifyCost:
    """By the batch's rows: the median of a plain step's latest seconds, and the line
    through the latest verifies' costs in those steps.
    One line for every draft size, so that any verify updates what every size is priced
    at: a size priced high once (a first, cold forward) would never run again to be
    measured anew."""

    _steps: dict[int, deque[float]] = field(default_factory=dict)
    _verifies: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    _step: dict[int, float] = field(default_factory=dict)  # the medians, kept current
    _line: dict[int, Line] = field(default_factory=dict)
    _since_step: dict[int, int] = field(default_factory=dict)  # verifies since a step

    def stepped(self, rows: int, seconds: float) -> None:
        """A plain step of `rows` requests took `seconds` (computed and read)."""
        latest = self._steps.setdefault(rows, deque(maxlen=RECENT))
        latest.append(seconds)
        self._step[rows] = statistics.median(latest)
        self._since_step[rows] = 0

    def verified(self, rows: int, drafted: int, seconds: float) -> None:
        """A verify of `rows` requests, `drafted` tokens in all, took `seconds`
        (computed, drawn and handed on, as a plain step's tokens are)."""
        self._since_step[rows] = self._since_step.get(rows, 0) + 1
        step = self._step.get(rows)
        if step and drafted > 0:
            latest = self._verifies.setdefault(rows, deque(maxlen=RECENT))
            latest.append((drafted, max(0.0, seconds / step - 1.0)))
            self._line[rows] = _fit(latest, _prior(rows))

    def stale(self, rows: int) -> bool:
        """Whether a batch of `rows` requests takes a plain step, timed, before its next
        verify: RESTEP verifies ran since its last one."""
        return self._since_step.get(rows, 0) >= RESTEP

    def ratio(self, rows: int, drafted: int) -> float:
        """A verify of `drafted` tokens in all, in plain steps of the same batch."""
        if drafted <= 0:
            return 1.0
        line = self._line.get(rows) or Line(0.0, _prior(rows))
        return 1.0 + line.overhead + line.per_token * drafted

    def share(self, rows: int, k: int) -> float:
        """A verify where one request of `rows` drafts `k` tokens, in that request's own
        share of a plain step (a step yields one token per request)."""
        return 1.0 + rows * (self.ratio(rows, k) - 1.0)

    def longest_paying(self, acceptance: float, most: int, rows: int = 1) -> int:
        """The longest draft (up to `most`) whose verify yields over WORTH tokens per step
        of its cost; 0: none does."""
        for k in range(most, 0, -1):
            if expected_tokens(acceptance, k) / self.share(rows, k) > WORTH:
                return k
        return 0

    def ride_length(self, acceptance: float, most: int, rows: int) -> int:
        """The tokens (up to `most`) a request drafting nothing adds to a verify of `rows`
        requests that runs anyway (engine/decode/lookup.py `_ride`): the verify's overhead
        is paid, so each token costs the line's per-token steps alone, in the request's
        share (x rows), and the i-th is drafted while its chance of being kept
        (acceptance^i) beats WORTH x that cost."""
        line = self._line.get(rows) or Line(0.0, _prior(rows))
        price = WORTH * rows * line.per_token
        k = 0
        while k < most and acceptance ** (k + 1) > price:
            k += 1
        return k

    def best_draft(self, acceptance: float, most: int, rows: int = 1) -> tuple[int, float]:
        """The draft length (0 to `most`) whose verify yields the most tokens per step
        of its cost, and that yield; 0 (a plain step, yield 1) when no draft yields
        WORTH or more."""
        best, value = 0, 1.0
        for k in range(1, most + 1):
            worth = expected_tokens(acceptance, k) / self.share(rows, k)
            if worth > max(value, WORTH):
                best, value = k, worth
        return best, value


def _prior(rows: int) -> float:
    # A drafted token costs about the same seconds whatever the batch: so much less of
    # a batch's longer step.
    return PRIOR_TOKEN_COST / rows


def _fit(samples: Sequence[tuple[int, float]], prior: float) -> Line:
    """The line through (tokens drafted, steps past one): its slope the median of the
    slopes between samples of different sizes, weighted by how far apart they are, its
    overhead the median of what each sample leaves (Theil-Sen). Samples of one size
    alone price a token at most at the prior, the rest of their cost overhead: a line
    through the origin would price a long draft by a short one's overhead."""
    slopes = sorted(
        ((c2 - c1) / (n2 - n1), abs(n2 - n1))
        for (n1, c1), (n2, c2) in combinations(samples, 2)
        if n1 != n2
    )
    if slopes:
        per_token = max(0.0, _weighted_median(slopes))
    else:
        size = samples[-1][0]
        per_token = min(statistics.median(c for _, c in samples) / size, prior)
    overhead = statistics.median(c - per_token * n for n, c in samples)
    return Line(max(0.0, overhead), per_token)


def _weighted_median(values: Sequence[tuple[float, float]]) -> float:
    """The value at half the weight of sorted (value, weight) pairs."""
    half, seen = sum(w for _, w in values) / 2, 0.0
    for value, weight in values:
        seen += weight
        if seen >= half:
            return value
    return values[-1][0]
