"""A request's draft length under prompt lookup: k adapts to its recent acceptance and
the verify cost measured (cost.py), a request whose drafts do not pay pauses (longer
each time in a row), and a paused one whose reply starts copying probes at once.
Engine thread only."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_prefix.engine.lookup.cost import VerifyCost
from mlx_prefix.engine.lookup.ngram import MATCH_CAP, NgramIndex

START_K = 2  # a request's first draft: a wrong one costs a verify of few rows
PAUSE_FIRST = 8  # plain steps after k fell to 0, before probing again
PAUSE_MAX = 256  # the pause doubles up to this while probes keep failing
PROBE_MATCH = 4  # a cold request drafts only from a match agreeing over this many tokens
PRIOR_KEPT, PRIOR_CUT = 1.0, 1.0  # a request's acceptance before its first verify: 1/2
FORGET = 0.7  # an earlier verify's weight in a request's acceptance, against the latest


@dataclass(slots=True)
class LookupState:
    """A request's index and its adaptive draft length."""

    index: NgramIndex
    k: int  # draft tokens of its next verify (0: paused)
    pause: int = 0  # plain steps left before the next probe
    backoff: int = PAUSE_FIRST  # the next pause
    hot: bool = False  # its last verify kept a drafted token: any match drafts
    # Its recent verifies' drafted tokens kept and drafts cut, the older ones weighing
    # less (FORGET per verify): the chance that a drafted token is kept after the ones
    # before it were.
    kept: float = PRIOR_KEPT
    cut: float = PRIOR_CUT
    probing: bool = True  # its next verify is a probe (its first, or after a pause)
    waited: int = 0  # plain steps of its pause so far

    def draft(self, limit: int, room: int, copy_pays: bool) -> list[int]:
        """This step's draft ([]: a plain step), at most `limit` tokens and `room` (the
        reply's tokens left after this step's own); `copy_pays` is read while paused
        (`resumed`). Cold (nothing kept at its last
        verify, or none yet), only a match that agrees over PROBE_MATCH tokens drafts:
        a chance n-gram in a reply that copies nothing costs no verify."""
        if self.pause and not self.resumed(copy_pays):
            self.tick()
            return []
        k = min(self.k, limit, room)
        if k <= 0:
            return []
        drafted = self.index.propose(k)
        if not self.hot and self.index.matched < PROBE_MATCH:
            return []
        return drafted

    def tick(self) -> None:
        """A plain step of a paused request: the last one before its probe sets k = 1."""
        self.pause, self.waited = self.pause - 1, self.waited + 1
        self.k = 0 if self.pause else 1
        self.probing = not self.pause

    def resumed(self, copy_pays: bool) -> bool:
        """Whether it is not paused, or its pause ends now: its reply's end agrees with
        an earlier occurrence over MATCH_CAP tokens (a copy began: a long pause would
        decode it plainly), PAUSE_FIRST steps or more into the pause, where a copy's
        drafts would pay (`copy_pays`: a draft kept whole pays at the measured cost)."""
        if not (self.pause and copy_pays and self.waited >= PAUSE_FIRST):
            return not self.pause
        if self.index.agreement() >= MATCH_CAP:
            self.pause, self.k, self.probing = 0, START_K, True
        return not self.pause

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.cut)

    def adapt(self, drafted: int, accepted: int, limit: int, cost: VerifyCost, rows: int) -> None:
        """After a verify: k becomes the draft length whose verify yields the most tokens
        per step of its measured cost at this acceptance (cost.py), or twice a
        draft kept whole; 0 (none pays) pauses the request, longer each time in a row."""
        self.rode(drafted, accepted)
        self.probing = False
        self.k, _ = cost.best_draft(self.acceptance, limit, rows)
        if self.k and accepted == drafted:  # the estimate lags a run of whole drafts kept:
            most = min(limit, 2 * drafted)  # twice as long, as far as it still pays
            self.k = max(self.k, cost.longest_paying(self.acceptance, most, rows))
        if self.k:
            self.backoff = PAUSE_FIRST
        else:
            self._pause()

    def rode(self, drafted: int, accepted: int) -> None:
        """After a verify it drafted in: its acceptance learns from it. A ride on
        another's verify (engine/decode/lookup.py `_ride`) does only this; its k and
        pause stand, since it paid no verify of its own."""
        self.hot = accepted > 0
        self.kept = FORGET * self.kept + accepted
        self.cut = FORGET * self.cut + (accepted < drafted)

    def decline(self, drafted: int, limit: int, cost: VerifyCost, rows: int) -> None:
        """Its draft of `drafted` tokens was not verified. Where that draft does not pay
        by itself at the cost measured since k was chosen, k becomes the longest that
        does, or 0 (a pause): a request whose drafts never pay would otherwise draft at
        every step, never verify, and never be measured again. Where it does pay (it was
        refused beside rows whose drafts do not), it drafts again at the next step:
        pausing it would leave the others' drafts unpaid too."""
        paying = cost.longest_paying(self.acceptance, drafted, rows)
        if paying == drafted:
            return
        self.k = paying
        if not self.k:
            self._pause()

    def _pause(self) -> None:
        """Plain steps for its backoff, twice as many next time in a row."""
        self.pause, self.waited = self.backoff, 0
        self.backoff = min(PAUSE_MAX, 2 * self.backoff)
