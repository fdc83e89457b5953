"""Prompt lookup's drafts weighed against what a verify costs (engine/lookup/cost.py,
engine/decode/lookup.py): the index drafts from the block a copy is at, k is the length
whose verify pays most at the request's acceptance and the measured cost, and where no
draft pays the request takes plain steps; the reply is plain decoding's throughout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.engine_helpers import collect, run, same_reply, submit_together
from test_engine_prompt_lookup import FILE, LOOKUP, PLAIN, PROMPT, _sampling, _tokens, scripted

from mlx_prefix.engine.decode.lookup import PromptLookup
from mlx_prefix.engine.lookup.cost import RESTEP, WORTH, VerifyCost, expected_tokens
from mlx_prefix.engine.lookup.draft_length import LookupState
from mlx_prefix.engine.lookup.ngram import MATCH_CAP, NgramIndex


def test_the_index_drafts_from_the_block_the_copy_is_at():
    # Look-alike blocks "7 B 8 i 9": a copy at block 3's "7 B 8 3 9 7 B 8" goes on with
    # block 4's number; the latest "9 7 B 8" is followed by the last block's.
    blocks = [t for i in range(1, 8) for t in (7, 100, 8, 200 + i, 9)]
    index = NgramIndex()
    index.extend([*blocks, 7, 100, 8, 203, 9, 7, 100, 8])
    assert index.propose(3) == [204, 9, 7]
    assert index.matched == 9  # back to block 2's last token, as far as the copy's


# The timings' own methods (tests/conftest.py prices every engine's verify at the prior).
STEPPED, VERIFIED = VerifyCost.stepped, VerifyCost.verified
TICK, ADAPT = LookupState.tick, LookupState.adapt


@pytest.fixture
def timed(monkeypatch):
    monkeypatch.setattr(VerifyCost, "stepped", STEPPED)
    monkeypatch.setattr(VerifyCost, "verified", VERIFIED)


def test_a_verify_costs_what_was_measured_per_token(timed):
    cost = VerifyCost()
    assert cost.ratio(1, 0) == 1.0 and cost.ratio(1, 4) > 1.0  # the prior, until timed
    cost.stepped(1, 0.1)
    cost.verified(1, 8, 0.3)  # 8 drafted at 3 steps: 0.25 step a token
    assert cost.ratio(1, 8) == pytest.approx(3.0) and cost.ratio(1, 2) == pytest.approx(1.5)
    cost.verified(2, 8, 5.0)  # a batch of 2 has no step timed yet: nothing learnt
    assert cost.ratio(2, 8) == pytest.approx(1.0 + 8 * 0.25 / 2)  # the prior, a 2-step's
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 8) == 9


def test_a_verify_is_priced_by_its_overhead_and_its_tokens_whatever_one_timing_says(timed):
    # 4 requests: any verify costs 0.3 of their step, and 0.05 a drafted token.
    cost = VerifyCost()
    cost.stepped(4, 1.0)
    for drafted in (1, 8, 4, 16, 2):
        cost.verified(4, drafted, 1.3 + 0.05 * drafted)
    cost.verified(4, 4, 5.0)  # one far off (the machine was busy): the line holds
    assert cost.ratio(4, 8) == pytest.approx(1.7) and cost.ratio(4, 32) == pytest.approx(2.9)
    # One request drafting 8 alone, in its share of the step (a step yields 4 tokens).
    assert cost.share(4, 8) == pytest.approx(1.0 + 4 * 0.7)
    # Short drafts of one size only: the per-token price stays at most the prior's, the
    # rest is overhead (a line through the origin would price 8 tokens at 8 overheads).
    short = VerifyCost()
    short.stepped(4, 1.0)
    short.verified(4, 1, 1.4)
    assert short.ratio(4, 8) == pytest.approx(1.0 + 0.4 - 0.25 / 4 + 8 * 0.25 / 4)


def test_a_lone_draft_beside_rows_drafting_nothing_verifies_or_pauses(timed):
    # 4 requests, one of them drafting: any verify costs 0.3 of their step and 0.05 a
    # drafted token. 3 tokens kept at 0.8 each yield 2.95 for 2.8 steps of the request's
    # share: it pays by itself, so it is verified. Weighing the 3 rows that draft nothing
    # too (their 3 tokens over 1.45 steps, short of WORTH) refused it at every step while
    # `decline` kept it, and the request never verified nor paused.
    lookup = PromptLookup(None)
    lookup.cost.stepped(4, 1.0)
    for drafted in (1, 2, 4, 8):
        lookup.cost.verified(4, drafted, 1.3 + 0.05 * drafted)
    members = [object() for _ in range(4)]

    def lone(acceptance: float, k: int) -> tuple[LookupState, bool]:
        state = LookupState(NgramIndex(), k, probing=False, kept=acceptance, cut=1 - acceptance)
        lookup._states = {id(members[0]): state}
        drafts = [[5] * k, [], [], []]
        return state, lookup._pays(members, drafts)  # type: ignore[arg-type]

    state, pays = lone(0.8, 3)
    assert pays and expected_tokens(0.8, 3) / lookup.cost.share(4, 3) > WORTH
    # Whatever its acceptance and length, a lone draft refused is shortened or paused.
    for acceptance in (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.99):
        for k in range(1, 9):
            state, pays = lone(acceptance, k)
            if not pays:
                state.decline(k, 8, lookup.cost, 4)
                assert state.k < k, (acceptance, k)


def test_a_request_drafting_nothing_rides_a_verify_that_runs_anyway(timed):
    # 4 requests: a verify costs 0.3 of their step and 0.05 a drafted token. A request
    # keeping 0.6 of its drafted tokens pays for no verify of its own, but beside
    # another request's verify (its overhead paid) its i-th token is kept with chance
    # 0.6^i against 1.05 x 4 x 0.05 = 0.21 of its share: 3 tokens ride, fewer where
    # the verify is narrower, none where little is kept.
    cost = VerifyCost()
    cost.stepped(4, 1.0)
    for drafted in (1, 2, 4, 8):
        cost.verified(4, drafted, 1.3 + 0.05 * drafted)
    assert cost.best_draft(0.6, 8, 4) == (0, 1.0)
    assert cost.ride_length(0.6, 8, 4) == 3
    assert cost.ride_length(0.6, 2, 4) == 2
    assert cost.ride_length(0.2, 8, 4) == 0
    assert cost.ride_length(0.99, 8, 4) == 8


def test_a_paused_request_copying_rides_the_others_verify_and_replies_as_plain(
    monkeypatch, verified_rows
):
    # Two requests copying the file; the second never drafts by itself (as if paused
    # throughout). Its copy rides the first's verifies: it drafts in them, keeps those
    # tokens, and its reply is plain decoding's.
    draft = PromptLookup._draft

    def paused(self, running, rows):
        drafted = draft(self, running, rows)  # its index kept up, as a paused one's is
        return [] if running.job.sampling.seed == 10 else drafted

    monkeypatch.setattr(PromptLookup, "_draft", paused)
    scripts = {7: _tokens(FILE), 10: _tokens(FILE)}
    with scripted(scripts) as engine:
        plain = [run(engine, PROMPT, sampling=_sampling(PLAIN, seed=s)) for s in scripts]
        together = [
            collect(h)
            for h in submit_together(
                engine, [PROMPT] * 2, [_sampling(LOOKUP, seed=s) for s in scripts]
            )
        ]
        stats = engine.loop.decode.lookup.stats
    for looked, alone in zip(together, plain, strict=True):
        same_reply(looked, alone)
    assert together[1].text == FILE
    rides = [row[1] for row in verified_rows if len(row) == 2]
    assert sum(rides) > 0 and max(rides) > 1  # it drafted, and longer as it kept them
    assert stats.accepted > 0


def test_verifies_back_to_back_take_a_plain_step_to_time_it_again(timed):
    # A step's time grows with the context: after RESTEP verifies with no plain step
    # between, the batch takes one (timed by the decode phase) before verifying again,
    # and a paused request counts it.
    def running() -> SimpleNamespace:
        job = SimpleNamespace(
            prompt=SimpleNamespace(vision=None), sampling=SimpleNamespace(prompt_lookup=None)
        )
        return SimpleNamespace(job=job)

    lookup = PromptLookup(None)
    members = [running(), running()]
    paused = LookupState(NgramIndex(), 0, pause=5)
    lookup._states = {id(members[0]): paused}
    lookup.cost.stepped(2, 1.0)
    for _ in range(RESTEP):
        assert not lookup.cost.stale(2)
        lookup.cost.verified(2, 8, 2.0)
    assert lookup.cost.stale(2) and not lookup.cost.stale(4)
    batch = SimpleNamespace(members=members)
    assert lookup.step(None, None, batch, None) is False  # type: ignore[arg-type]
    assert paused.pause == 4
    lookup.cost.stepped(2, 1.0)
    assert not lookup.cost.stale(2)


@pytest.mark.parametrize(
    ("row_cost", "acceptance", "k"),
    [
        (0.02, 0.9, 8),  # rows nearly free (a GPU at a small batch): the longest draft
        (0.3, 0.85, 4),  # a CPU at a long context: a shorter draft yields more per step
        (0.3, 0.2, 0),  # little kept: no draft pays, plain steps
        (1.0, 0.99, 0),  # a row costs a step: never
    ],
)
def test_k_is_the_draft_that_yields_most_per_step_of_cost(timed, row_cost, acceptance, k):
    cost = VerifyCost()
    cost.stepped(1, 1.0)
    cost.verified(1, 1, 1.0 + row_cost)
    cost.verified(1, 2, 1.0 + 2 * row_cost)  # two sizes: a line, no overhead
    best, value = cost.best_draft(acceptance, 8)
    assert best == k
    if k:
        assert value == max(expected_tokens(acceptance, n) / cost.ratio(1, n) for n in range(1, 9))


def test_where_verifies_cost_too_much_a_copy_takes_plain_steps_and_the_same_reply(monkeypatch):
    # Each verify row priced at a whole step: past its probes a request that keeps
    # every draft still decodes plainly, and the reply is plain decoding's.
    monkeypatch.setattr(VerifyCost, "ratio", lambda self, rows, drafted: 1.0 + drafted)
    with scripted({7: _tokens(FILE)}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
        stats = engine.loop.decode.lookup.stats
    same_reply(looked, plain)
    assert 0 < stats.steps <= 5 and stats.accepted == stats.drafted  # probes, further apart


def test_cheap_verifies_let_a_copy_draft_its_longest(monkeypatch):
    monkeypatch.setattr(VerifyCost, "ratio", lambda self, rows, drafted: 1.01 + 0.01 * drafted)
    with scripted({7: _tokens(FILE)}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
        stats = engine.loop.decode.lookup.stats
    same_reply(looked, plain)
    assert stats.accepted > 0 and stats.steps < len(looked.tokens) // 4


def test_a_draft_that_stops_paying_pauses_then_drafts_again_once_it_pays(monkeypatch):
    # Verifies cheap, then (from the third) priced at a whole step a row, then cheap again
    # after 4 plain steps of a pause: a request whose draft stopped paying pauses and
    # probes again, where it used to keep its k, draft at every step and never verify.
    verified: list[int] = []  # each verify's drafted tokens
    phase = {"expensive": False, "ticks": 0}

    def ratio(self, rows: int, drafted: int) -> float:
        return 1.0 + drafted if phase["expensive"] else 1.01 + 0.01 * drafted

    def adapt(self, drafted, accepted, limit, cost, rows) -> None:
        ADAPT(self, drafted, accepted, limit, cost, rows)
        verified.append(drafted)
        phase["expensive"] = phase["expensive"] or len(verified) == 3  # k chosen cheap

    def tick(self) -> None:
        phase["ticks"] += 1
        phase["expensive"] = phase["expensive"] and phase["ticks"] < 4
        TICK(self)

    monkeypatch.setattr(VerifyCost, "ratio", ratio)
    monkeypatch.setattr(LookupState, "adapt", adapt)
    monkeypatch.setattr(LookupState, "tick", tick)
    with scripted({7: _tokens(FILE)}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
    same_reply(looked, plain)
    assert phase["ticks"] >= 4  # it paused
    assert len(verified) > 4 and max(verified[3:]) == LOOKUP  # and drafted its longest again


def test_a_paused_request_drafts_again_soon_after_its_reply_starts_copying(monkeypatch):
    # The reply first strays from the file every 5th token (each probe then fails: its
    # pauses grow to 64 steps), then copies the file whole. The pause ends once the
    # reply's last MATCH_CAP tokens agree with the file, not 64 steps later.
    source = _tokens(FILE)
    stray = _tokens(" Zanzibar")[0]
    noise = [t for i in range(16) for t in (*source[6 * i + 1 : 6 * i + 5], stray)]
    at: list[int] = []  # the reply's tokens so far at each verify

    def adapt(self, drafted, accepted, limit, cost, rows) -> None:
        at.append(len(self.index) - len(prompt_tokens))
        ADAPT(self, drafted, accepted, limit, cost, rows)

    monkeypatch.setattr(LookupState, "adapt", adapt)
    with scripted({7: noise + source}) as engine:
        prompt_tokens = engine.plan(PROMPT).tokens
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
        stats = engine.loop.decode.lookup.stats
    same_reply(looked, plain)
    assert sum(a < len(noise) for a in at) >= 4  # the noise's probes failed, pausing longer
    copying = [a - len(noise) for a in at if a >= len(noise)]
    assert copying and copying[0] <= MATCH_CAP + 4
    assert stats.accepted >= len(source) * 3 // 4
