"""The n-gram index prompt lookup drafts from: where each n-gram of a request's sequence
(prompt and reply so far) was followed, and the draft after the occurrence that agrees
with the sequence's end the furthest (a copy of look-alike blocks stays on its block).
Pure Python, engine thread only."""

from __future__ import annotations

from collections.abc import Sequence

NGRAM_SIZES = (4, 3, 2)  # the sequence's last n tokens looked up, longest first
MATCH_CAP = 16  # tokens compared back from a match (NgramIndex.matched)
CANDIDATES = 64  # an n-gram's latest occurrences compared (NgramIndex._match)


class NgramIndex:
    """Where each n-gram of a sequence was last followed by a token."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES):
        self.sizes = tuple(sizes)
        self.tokens: list[int] = []
        # n-gram -> the positions of the tokens after its occurrences, oldest first. The
        # sequence's own last n-grams have no follower yet, so a look-up finds earlier ones.
        self._next: dict[tuple[int, ...], list[int]] = {}
        self._distance: int | None = None  # from the sequence's end to the match followed
        self.matched = 0  # the last proposal's agreeing tokens (`propose`)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq, index = self.tokens, self._next
        for token in tokens:
            end = len(seq)  # `token`'s position: the n-grams ending before it are followed
            for n in self.sizes:
                if end >= n:
                    index.setdefault(tuple(seq[end - n : end]), []).append(end)
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        """k tokens after the match: the one followed last while its last tokens still
        agree (a copy of a repetitive file stays on its line), else the latest earlier
        occurrence of the longest matching suffix; [] when none occurred before.
        `matched` is then how many tokens before the match agree with the sequence's end
        (up to MATCH_CAP): a copy's is long, a chance n-gram's short."""
        seq, end = self.tokens, len(self.tokens)
        at = self._match()
        if at is None:
            self._distance, self.matched = None, 0
            return []
        self._distance = end - at  # a copy's source and its end advance together
        self.matched = self._agreeing(at)
        # Past the sequence's end the match repeats what it just proposed: a run or a
        # loop goes on as it went (period end - at).
        out = seq[at : at + k]
        while len(out) < k:
            out.append(out[len(out) - (end - at)])
        return out

    def agreement(self) -> int:
        """What `matched` would be if the sequence's end drafted now (0: no match)."""
        at = self._match()
        return 0 if at is None else self._agreeing(at)

    def _match(self) -> int | None:
        """The position after the match `propose` drafts from (None: no match). In a
        file of look-alike blocks the latest occurrence of a block's opening is the last
        block's; the block a copy is at agrees further back."""
        seq, end = self.tokens, len(self.tokens)
        followed = None
        if self._distance is not None:
            n, source = self.sizes[-1], end - self._distance
            if n <= source < end and seq[source - n : source] == seq[end - n :]:
                followed = source
                if self._agreeing(source) >= MATCH_CAP:
                    return source  # a copy going on: nothing agrees further
        for n in self.sizes:
            if end > n and (found := self._next.get(tuple(seq[-n:]))):
                best, most = followed, -1 if followed is None else self._agreeing(followed)
                for at in reversed(found[-CANDIDATES:]):  # latest first: it wins ties
                    if (agree := self._agreeing(at)) > most:
                        best, most = at, agree
                return best
        return followed

    def _agreeing(self, at: int) -> int:
        """Tokens before `at` that agree with the sequence's last ones, up to MATCH_CAP."""
        seq, n = self.tokens, 0
        while n < MATCH_CAP and n < at and seq[at - 1 - n] == seq[-1 - n]:
            n += 1
        return n
