"""Prompt lookup decoding: each decoding request drafts its next tokens from its own
sequence (prompt and reply so far), no second model, and verifies them in one forward
(verify.py: the reply is plain decoding's); requests decoding together, in one forward
of rows of different lengths (verify_rows.py; a row without a draft decodes one).

The draft: the k tokens after an earlier occurrence of the sequence's last 4, 3 or 2
tokens (the longest found), the occurrence whose tokens before agree with the sequence's
end the furthest (a copy of look-alike blocks stays on its block), on a tie the one it
followed last, then the latest. A reply that repeats what it read keeps most of them.

A verify of k+1 rows costs more than a step (verify_cost.py measures how much, on the
engine as it runs), so a request verifies only where it pays. Cold (no draft kept at
its last verify, or none yet), it drafts only from a match that agrees with its last
PROBE_MATCH tokens or more (a chance "of the" in a story costs no verify); hot, any
match drafts. k starts at 2, then is the length whose verify yields the most tokens per
step of its measured cost at the request's recent acceptance (or doubles while drafts
are kept whole and it still pays); where none pays, or its draft no longer pays at the
cost measured since, the request takes plain steps for a pause that doubles each time
(8 up to 256 steps), then probes with k = 1, or sooner where its reply's end agrees
with an earlier occurrence over MATCH_CAP tokens (a copy began). Without a draft the step
is plain, and while no request may draft (`quiet`) a step may launch before the one
ahead is read, as without lookup (engine/decode/phase.py, on an asynchronous device).

Recurrent and sliding-window models draft too (a rejected draft is taken back from
their state: cache/layers/rewind.py), together as well for Qwen3.5, Qwen3-Next and
Nemotron-H (verify_rows.py); other recurrent models take plain steps while several
decode, as quantized KV always does. Engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.speculative import verify_matches
from mlx_prefix.engine.decode.verify import Accept, SpeculationStats, verify_step
from mlx_prefix.engine.decode.verify_rows import rows_verifiable, verify_rows
from mlx_prefix.engine.forward.verify_cost import WORTH, VerifyCost, expected_tokens
from mlx_prefix.models.load import LoadedModel

log = logging.getLogger("mlx_prefix.engine")

DEFAULT_TOKENS = 8  # draft tokens at most, unless --prompt-lookup says otherwise
NGRAM_SIZES = (4, 3, 2)  # the sequence's last n tokens looked up, longest first
START_K = 2  # a request's first draft: a wrong one costs a verify of few rows
PAUSE_FIRST = 8  # plain steps after k fell to 0, before probing again
PAUSE_MAX = 256  # the pause doubles up to this while probes keep failing
MATCH_CAP = 16  # tokens compared back from a match (NgramIndex.matched)
PROBE_MATCH = 4  # a cold request drafts only from a match agreeing over this many tokens
PRIOR_KEPT, PRIOR_CUT = 1.0, 1.0  # a request's acceptance before its first verify: 1/2
FORGET = 0.7  # an earlier verify's weight in a request's acceptance, against the latest
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
        reply's tokens left after this step's own). Cold (nothing kept at its last
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
        per step of its measured cost at this acceptance (verify_cost.py), or twice a
        draft kept whole; 0 (none pays) pauses the request, longer each time in a row."""
        self.hot, self.probing = accepted > 0, False
        self.kept = FORGET * self.kept + accepted
        self.cut = FORGET * self.cut + (accepted < drafted)
        self.k, _ = cost.best_draft(self.acceptance, limit, rows)
        if self.k and accepted == drafted:  # the estimate lags a run of whole drafts kept:
            most = min(limit, 2 * drafted)  # twice as long, as far as it still pays
            self.k = max(self.k, cost.longest_paying(self.acceptance, most, rows))
        if self.k:
            self.backoff = PAUSE_FIRST
        else:
            self._pause()

    def decline(self, drafted: int, limit: int, cost: VerifyCost, rows: int) -> None:
        """Its draft of `drafted` tokens was not verified: it does not pay at the cost
        measured since k was chosen. k becomes a shorter draft that pays, or 0 (a pause):
        a request whose drafts never pay would otherwise draft at every step, never
        verify, and never be measured again."""
        self.k = min(drafted - 1, cost.best_draft(self.acceptance, limit, rows)[0])
        if not self.k:
            self._pause()

    def _pause(self) -> None:
        """Plain steps for its backoff, twice as many next time in a row."""
        self.pause, self.waited = self.backoff, 0
        self.backoff = min(PAUSE_MAX, 2 * self.backoff)


class PromptLookup:
    """The engine's prompt lookup: each decoding request's LookupState, by request."""

    def __init__(self, max_tokens: int | None, unusable: str | None = None):
        # The server's --prompt-lookup: draft tokens at most (0: off; None: DEFAULT_TOKENS).
        self.max_tokens = DEFAULT_TOKENS if max_tokens is None else max_tokens
        self.unusable = unusable  # why it never drafts on this engine (quantized KV)
        self.stats = SpeculationStats()
        self.cost = VerifyCost()  # a verify's measured cost in plain steps
        self.exact: bool | None = None  # the verify forward keeps this model's numbers
        self._states: dict[int, LookupState] = {}  # by id(Running)

    def check(self, model: LoadedModel, rows: int | None) -> bool:
        """Whether a verify forward gives plain decoding's numbers on this model here
        (--deterministic, `rows` set: checked once, on the engine thread, by
        engine/decode/speculative.py's startup check). By default the verify is the
        model's own forward, whose last bits may differ as a batched step's do."""
        if rows is None:
            return True
        if self.exact is None:
            self.exact = verify_matches(model.model, rows, model.tokenizer.vocab_size)
            if not self.exact:
                log.warning("a verify forward changes this model's numbers here: no prompt lookup")
        return self.exact

    def limit(self, running: Running) -> int:
        """The request's most draft tokens per verify (0: plain decoding)."""
        if self.unusable is not None or running.job.prompt.vision is not None:
            return 0  # image placeholders are not the model's token ids
        if self.exact is False:
            return 0  # the startup check failed: nobody drafts, and steps may overlap (`quiet`)
        asked = running.job.sampling.prompt_lookup
        return self.max_tokens if asked is None else asked

    def step(
        self, model: LoadedModel, rows: int | None, batch: DecodeBatch,
        accept: Callable[[Running], Accept],
    ) -> bool:  # fmt: skip
        """A verify step of the batch if some request drafts now: a lone request's
        drafts verified alone (verify.py), several requests' in one forward, each row
        its own (verify_rows.py; a row without a draft decodes one position). False:
        none drafts, take a plain step."""
        members = batch.members
        if not any(self.limit(r) > 0 for r in members) or not self.check(model, rows):
            return False
        drafts = [self._draft(r, len(members)) for r in members]
        if not any(drafts):
            return False
        if not self._pays(members, drafts):
            for running, drafted in zip(members, drafts, strict=True):
                if drafted and (state := self._states.get(id(running))) is not None:
                    state.decline(len(drafted), self.limit(running), self.cost, len(members))
            return False
        rows_now, width = len(members), max(len(d) for d in drafts) + 1
        if len(members) == 1:
            running, drafted = members[0], drafts[0]
            start = time.perf_counter()
            _, accepted = verify_step(batch, running, drafted, accept(running), self.stats)
            self.cost.verified(rows_now, width, time.perf_counter() - start)
            self._adapt(running, len(drafted), accepted, rows_now)
            return True
        if not rows_verifiable(batch):
            return False
        start = time.perf_counter()
        drawn = verify_rows(batch, drafts, accept, self.stats)
        self.cost.verified(rows_now, width, time.perf_counter() - start)
        for (running, row), drafted in zip(drawn, drafts, strict=True):
            if drafted:
                self._adapt(running, len(drafted), row.hits, rows_now)
        return True

    def _pays(self, members: Sequence[Running], drafts: Sequence[list[int]]) -> bool:
        """Whether the verify of these drafts yields WORTH more tokens per step of its
        measured cost than a plain step (every row pays for the widest draft's width);
        a request's probe always runs: its acceptance is what it measures."""
        width = max(len(d) for d in drafts) + 1
        tokens = 0.0
        for running, drafted in zip(members, drafts, strict=True):
            state = self._states.get(id(running))
            if not drafted or state is None:
                tokens += 1
            elif state.probing:
                return True
            else:
                tokens += expected_tokens(state.acceptance, len(drafted))
        return tokens / self.cost.ratio(len(members), width) > len(members) * WORTH

    def stepped(self, rows: int, seconds: float) -> None:
        """A plain step of `rows` requests took `seconds` (phase.py): a verify's yardstick."""
        self.cost.stepped(rows, seconds)

    def _adapt(self, running: Running, drafted: int, accepted: int, rows: int) -> None:
        state = self._states.get(id(running))
        if state is not None:  # None: the request ended in the verify
            state.adapt(drafted, accepted, self.limit(running), self.cost, rows)

    def quiet(self, members: Sequence[Running]) -> bool:
        """Whether no request drafts at the next step, judged from the tokens read so far
        (one may be in flight): paused, or cold without a match that agrees over nearly
        PROBE_MATCH tokens. Then that step may launch before the one ahead is read, on a
        device that computes asynchronously (engine/decode/phase.py), as without lookup."""
        for running in members:
            limit = self.limit(running)
            if limit <= 0:
                continue
            state = self._state(running, limit)
            if not state.resumed(self._copy_pays(limit, len(members))):
                continue
            if state.hot or state.index.agreement() >= PROBE_MATCH - 1:
                return False
        return True

    def plain_step(self, members: Sequence[Running]) -> None:
        """A step launched without drafting (`quiet`): the paused requests count it."""
        for running in members:
            state = self._states.get(id(running))
            if state is not None and state.pause:
                state.tick()

    def _draft(self, running: Running, rows: int) -> list[int]:
        """The request's draft for this step ([]: none, it decodes one position)."""
        limit = self.limit(running)
        if limit <= 0:
            return []
        state = self._state(running, limit)
        room = running.limit - running.count - 1
        return state.draft(limit, room, self._copy_pays(limit, rows))

    def _copy_pays(self, limit: int, rows: int) -> bool:
        """Whether a draft kept whole pays at the cost measured for `rows` requests."""
        return self.cost.longest_paying(1.0, limit, rows) > 0

    def _state(self, running: Running, limit: int) -> LookupState:
        """The request's state, its index caught up with the tokens read so far."""
        state = self._states.get(id(running))
        if state is None:
            state = self._states[id(running)] = LookupState(NgramIndex(), min(limit, START_K))
        index, prompt = state.index, running.job.tokens
        if len(index) < len(prompt):
            index.extend(prompt)
        index.extend(running.emitted[len(index) - len(prompt) :])
        return state

    def forget(self, running: Running) -> None:
        self._states.pop(id(running), None)

    def clear(self) -> None:
        self._states.clear()
