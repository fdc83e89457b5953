"""Prompt lookup decoding: each decoding request drafts its next tokens from its own
sequence (prompt and reply so far), no second model, and verifies them in one forward
(verify.py: the reply is plain decoding's); requests decoding together, in one forward
of rows of different lengths (verify_rows.py; a row without a draft decodes one).

The draft: the k tokens after an earlier occurrence of the sequence's last 4, 3 or 2
tokens (the longest found), the occurrence whose tokens before agree with the sequence's
end the furthest (a copy of look-alike blocks stays on its block), on a tie the one it
followed last, then the latest. A reply that repeats what it read keeps most of them.

A verify of k+1 rows costs more than a step (engine/lookup/cost.py measures how much, on
the engine as it runs), so a request verifies only where it pays. Cold (no draft kept at
its last verify, or none yet), it drafts only from a match that agrees with its last
PROBE_MATCH tokens or more (a chance "of the" in a story costs no verify); hot, any
match drafts. k starts at 2, then is the length whose verify yields the most tokens per
step of its measured cost at the request's recent acceptance (or doubles while drafts
are kept whole and it still pays); where none pays, or its draft no longer pays at the
cost measured since, the request takes plain steps for a pause that doubles each time (8
up to 256 steps), then probes with k = 1, or sooner where its reply's end agrees with an
earlier occurrence over MATCH_CAP tokens (a copy began). Where a verify of several
runs anyway, a request drafting nothing (paused too) whose reply is copying rides it,
its tokens priced at the verify's per-token cost alone (`_ride`). Without a draft the
step is plain, and while no request may draft (`quiet`) a step may launch before the one
ahead is read, as without lookup (engine/decode/phase.py, on an asynchronous device).

Recurrent and sliding-window models draft too (a rejected draft is taken back from their
state: cache/layers/rewind.py), together as well where verify_rows.py keeps a row's pads
out of its state (RECURRENT_MASKED: Qwen3.5, Mamba-1/-2, LFM2, RWKV-7...); others (Kimi
Linear...) take plain steps while several decode, as quantized KV does. Engine thread
only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.speculative import verify_matches
from mlx_prefix.engine.decode.verify import Accept, SpeculationStats, verify_step
from mlx_prefix.engine.decode.verify_rows import rows_verifiable, verify_rows
from mlx_prefix.engine.lookup.cost import WORTH, VerifyCost, expected_tokens
from mlx_prefix.engine.lookup.draft_length import PROBE_MATCH, START_K, LookupState
from mlx_prefix.engine.lookup.ngram import NgramIndex
from mlx_prefix.models.load import LoadedModel

log = logging.getLogger("mlx_prefix.engine")

DEFAULT_TOKENS = 8  # draft tokens at most, unless --prompt-lookup says otherwise


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
        if self.cost.stale(len(members)):
            self.plain_step(members)  # timed (phase.py): the step a verify is priced in
            return False
        drafts = [self._draft(r, len(members)) for r in members]
        if not any(drafts):
            return False
        if not self._pays(members, drafts):
            for running, drafted in zip(members, drafts, strict=True):
                if drafted and (state := self._states.get(id(running))) is not None:
                    state.decline(len(drafted), self.limit(running), self.cost, len(members))
            return False
        rows_now, in_all = len(members), sum(len(d) for d in drafts)
        if len(members) == 1:
            running, drafted = members[0], drafts[0]
            start = time.perf_counter()
            _, accepted = verify_step(batch, running, drafted, accept(running), self.stats)
            self.cost.verified(rows_now, in_all, time.perf_counter() - start)
            self._adapt(running, len(drafted), accepted, rows_now)
            return True
        if not rows_verifiable(batch):
            return False
        rides = self._ride(members, drafts)
        start = time.perf_counter()
        drawn = verify_rows(
            batch, [d or r for d, r in zip(drafts, rides, strict=True)], accept, self.stats
        )
        self.cost.verified(
            rows_now, in_all + sum(len(r) for r in rides), time.perf_counter() - start
        )
        for (running, row), drafted, rode in zip(drawn, drafts, rides, strict=True):
            if drafted:
                self._adapt(running, len(drafted), row.hits, rows_now)
            elif rode and (state := self._states.get(id(running))) is not None:
                state.rode(len(rode), row.hits)
        return True

    def _ride(self, members: Sequence[Running], drafts: Sequence[list[int]]) -> list[list[int]]:
        """The drafts of the requests drafting nothing (paused ones too) that ride on
        this step's verify of several: a request whose reply is copying (its match agrees
        over PROBE_MATCH tokens or more) drafts as far as its tokens pay at the verify's
        per-token cost alone (cost.py `ride_length`: the others' drafts pay its
        overhead), no wider than the widest draft. On a CPU a verify's rows share most
        of its cost (a batched matmul's time steps with its rows): where one request
        copies alone, the others copying beside it would each be priced a verify of
        their own, pause, and decode their copies plainly."""
        widest, rows = max(len(d) for d in drafts), len(members)
        rides: list[list[int]] = [[] for _ in members]
        for i, (running, drafted) in enumerate(zip(members, drafts, strict=True)):
            state = self._states.get(id(running))
            if drafted or state is None or state.index.agreement() < PROBE_MATCH:
                continue
            room = running.limit - running.count - 1
            most = min(widest, self.limit(running), room)
            if (k := self.cost.ride_length(state.acceptance, most, rows)) > 0:
                rides[i] = state.index.propose(k)
        return rides

    def _pays(self, members: Sequence[Running], drafts: Sequence[list[int]]) -> bool:
        """Whether the drafting requests' expected tokens beat WORTH per step of their own
        share of the verify (cost.py's `share`, the same test `decline` keeps a draft by):
        each drafting request's plain share, and the whole verify's cost past a plain
        step, priced by the tokens drafted in all (a shorter row's padding is not
        computed). A request drafting nothing yields its one token either way: it weighs
        on neither side, or a lone draft that pays by itself would be refused at every
        step and never paused. A request's probe always runs: its acceptance is what it
        measures."""
        drafting, tokens = 0, 0.0
        for running, drafted in zip(members, drafts, strict=True):
            state = self._states.get(id(running))
            if not drafted or state is None:
                continue
            if state.probing:
                return True
            drafting += 1
            tokens += expected_tokens(state.acceptance, len(drafted))
        rows, in_all = len(members), sum(len(d) for d in drafts)
        past_a_step = rows * (self.cost.ratio(rows, in_all) - 1.0)  # in requests' shares
        return tokens > WORTH * (drafting + past_a_step)

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
            if state.pause and not state.resumed(self._copy_pays(limit, len(members))):
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
        copy_pays = state.pause > 0 and self._copy_pays(limit, rows)  # read while paused
        return state.draft(limit, room, copy_pays)

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
