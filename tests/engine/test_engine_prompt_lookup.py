"""Prompt lookup decoding (engine/decode/lookup.py): drafts from the request's own
sequence, verified in one forward; the reply is plain decoding's, tokens and logprobs,
whether the drafts are all kept, all rejected or cut mid-way. Scripted samplers make
the replies copy (the tiny models' weights are random): what they draw is fixed, and
the logprobs each row reports are the model's own."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx
import pytest
from support.engine_helpers import ScriptedSampler, chat, collect, run, same_reply, submit_together
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving
from support.structured import AS_PERSON, check_person

from mlx_prefix.cli import build_parser
from mlx_prefix.cli.args import engine_config
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.decode import arrival, lookup
from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.decode.speculative import DraftMismatch
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.forward import verify_positions
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import SamplingParams

FILE = "\n".join(
    [
        "The harbour wall was built of grey granite in 1821.",
        "A keeper lived beside the lamp with two cats and a parrot.",
        "Fishing boats left before dawn whenever the tide allowed.",
        "Storms in autumn broke windows along Quay Street.",
        "Children collected driftwood on Sunday afternoons.",
        "Once a ferry to Lundy sailed twice each week in summer.",
        "Merchants traded salt, tea, rope and tar at the market.",
        "Gulls nested on every chimney of the customs house.",
    ]
)
PROMPT_TEXT = f"Repeat this file exactly:\n{FILE}"
PROMPT = chat(("user", PROMPT_TEXT))
LOOKUP, PLAIN = 8, 0  # a request's prompt_lookup


def _sampling(lookup: int | None, seed: int = 7, **extra: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=200, temperature=0.0, seed=seed, logprobs=True, prompt_lookup=lookup, **extra
    )


@contextlib.contextmanager
def scripted(scripts: Mapping[int, Sequence[int]], **config: Any) -> Iterator[Engine]:
    """An engine whose requests seeded with a key of `scripts` draw its tokens, then EOS
    (the logprobs reported are still the model's rows)."""
    model = loaded_test_model("dense")
    eos = min(model.tokenizer.eos_token_ids)

    def sampler(params: SamplingParams, *args: Any) -> Any:
        if params.seed in scripts:
            return ScriptedSampler(list(scripts[params.seed]), eos)
        return TokenSampler(params, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(arrival, "TokenSampler", sampler)
        engine = Engine(model, TEST_CACHE, EngineConfig(**({"deterministic": True} | config)))
        try:
            yield engine
        finally:
            engine.shutdown()


def _tokens(text: str) -> list[int]:
    return loaded_test_model("dense").tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def verifies(monkeypatch) -> list[tuple[list[int], int]]:
    """Each verify step's drafted tokens and how many of them the reply kept."""
    seen: list[tuple[list[int], int]] = []
    verify_step = lookup.verify_step

    def spy(batch, running, drafted, accept, stats):
        kept, accepted = verify_step(batch, running, drafted, accept, stats)
        seen.append((list(drafted), accepted))
        return kept, accepted

    monkeypatch.setattr(lookup, "verify_step", spy)
    return seen


def test_a_reply_that_copies_the_prompt_keeps_every_draft_and_ends_at_a_drafted_eos(verifies):
    with scripted({7: _tokens(FILE)}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        assert engine.loop.decode.lookup.stats.steps == 0  # 0: plain decoding
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
    same_reply(looked, plain)
    assert looked.text == FILE and looked.finish_reason == "stop"
    assert engine.loop.decode.lookup.stats.steps == len(verifies) < len(looked.tokens) // 3
    *whole, (last, kept) = verifies
    assert whole and all(accepted == len(drafted) for drafted, accepted in whole)
    # The prompt's end-of-turn (EOS) came in the last draft and was kept: the reply
    # ended there, inside the verify (no row after it was drawn).
    eos = min(loaded_test_model("dense").tokenizer.eos_token_ids)
    assert last[kept - 1] == eos and kept <= len(last)


def test_a_copy_cut_mid_way_keeps_part_of_a_draft():
    lines = FILE.split("\n")
    script = _tokens("\n".join(lines[:3]) + "\nNothing else happened there, ever.")
    with scripted({7: script}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
    same_reply(looked, plain)
    stats = engine.loop.decode.lookup.stats
    assert 0 < stats.accepted < stats.drafted


def test_drafts_all_rejected_back_off_and_the_reply_stays_exact():
    # "A B C D x1 A B C D x2 ...": each "A B C D" agrees over four tokens with the last
    # one, which was followed by another x, so every draft is wrong at its first token
    # (and a cold request drafts from nothing shorter).
    run_, cycles = [1000, 1001, 1002, 1003], 24
    script = [t for i in range(cycles) for t in (*run_, 2000 + i)]
    with scripted({7: script}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
    same_reply(looked, plain)
    assert looked.tokens == script
    stats = engine.loop.decode.lookup.stats
    assert stats.drafted > 0 and stats.accepted == 0
    # k halved to 0 and the request paused: fewer verifies than drafting chances.
    assert stats.steps < cycles // 2


# "A B x1 A B x2 ...": every "A B" matches the last one, a chance two-token match (the
# tokens before it differ), like "of the" in a story; nothing it drafts would be kept.
CHANCE = [t for i in range(30) for t in (1000, 1001, 2000 + i)]


def test_a_reply_that_copies_nothing_takes_no_verify(monkeypatch):
    matches = []
    propose = lookup.NgramIndex.propose

    def spy(self, k):
        drafted = propose(self, k)
        matches.append(bool(drafted))
        return drafted

    monkeypatch.setattr(lookup.NgramIndex, "propose", spy)
    with scripted({7: CHANCE}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
    same_reply(looked, plain)
    assert looked.tokens == CHANCE
    assert sum(matches) >= 20  # the index matched "A B" again and again
    # and no verify forward ran: every step a plain one
    assert engine.loop.decode.lookup.stats.steps == 0


def test_on_by_default_and_the_reply_is_plain_decodings():
    assert EngineConfig().prompt_lookup is None
    assert engine_config(build_parser().parse_args(["serve"])).prompt_lookup is None
    off = engine_config(build_parser().parse_args(["serve", "--prompt-lookup", "0"]))
    with scripted({7: _tokens(FILE)}) as engine:
        assert engine.loop.decode.lookup.max_tokens == lookup.DEFAULT_TOKENS
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(None))  # the server's default
        assert engine.loop.decode.lookup.stats.accepted > 0
    same_reply(looked, plain)
    with scripted({7: _tokens(FILE)}, prompt_lookup=off.prompt_lookup) as engine:
        same_reply(run(engine, PROMPT, sampling=_sampling(None)), plain)
        assert engine.loop.decode.lookup.stats.steps == 0


def test_steps_overlap_while_no_request_drafts_and_not_while_one_does():
    # A device that computes asynchronously launches a step before the one ahead is read
    # (phase.py): lookup on by default must not cost a reply that copies nothing that.
    with scripted({7: CHANCE, 8: _tokens(FILE)}) as engine:
        plain = [run(engine, PROMPT, sampling=_sampling(PLAIN, seed=s)) for s in (7, 8)]
        decode = engine.loop.decode
        decode.pipelined = True  # a GPU's default; the CPU's async_eval blocks (phase.py)
        decode.overlapped = 0
        chance = run(engine, PROMPT, sampling=_sampling(None, seed=7))
        assert decode.overlapped > len(CHANCE) // 2 and engine.loop.decode.lookup.stats.steps == 0
        copy = run(engine, PROMPT, sampling=_sampling(None, seed=8))
        assert engine.loop.decode.lookup.stats.accepted > 0
    same_reply(chance, plain[0])
    same_reply(copy, plain[1])


def test_a_stop_string_inside_an_accepted_draft_ends_the_reply_there():
    stop = ("Quay Street",)
    with scripted({7: _tokens(FILE)}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN, stop=stop))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP, stop=stop))
    same_reply(looked, plain)
    assert looked.finish_reason == "stop" and looked.text.endswith(
        "Storms in autumn broke windows along "
    )
    assert engine.loop.decode.lookup.stats.accepted > 0


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.9, seed=11, logprobs=True),
    ],
    ids=["greedy", "seeded"],
)
def test_the_models_own_reply_equals_plain_decoding(sampling):
    model = loaded_test_model("dense")
    replies, stats = [], []
    for k in (0, LOOKUP):
        with _engine(model, k, deterministic=True) as engine:
            replies.append(run(engine, PROMPT, sampling=sampling))
            stats.append(engine.loop.decode.lookup.stats)
    same_reply(replies[1], replies[0])
    assert stats[0].steps == 0
    if sampling.temperature == 0:  # the random model's greedy reply repeats itself
        assert stats[1].accepted > 0


@contextlib.contextmanager
def _engine(model, lookup: int, **config: Any) -> Iterator[Engine]:
    engine = Engine(model, TEST_CACHE, EngineConfig(prompt_lookup=lookup, **config))
    try:
        yield engine
    finally:
        engine.shutdown()


def test_a_request_cancelled_during_a_verify_ends_and_the_next_reply_is_exact(monkeypatch):
    verify = DecodeBatch.verify

    def cancelling(self, tokens):
        logits = verify(self, tokens)
        member = self.members[0]
        if isinstance(member, Running):  # not the startup check's batch
            member.job.handle.cancel()  # as a client's disconnect, mid-verify
        return logits

    with scripted({7: _tokens(FILE)}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        with monkeypatch.context() as patch:
            patch.setattr(DecodeBatch, "verify", cancelling)
            cancelled = run(engine, PROMPT, sampling=_sampling(LOOKUP))
        assert cancelled.finish_reason == "cancelled" and engine.loop.decode.lookup.stats.steps == 1
        assert cancelled.tokens == plain.tokens[: len(cancelled.tokens)]
        same_reply(run(engine, PROMPT, sampling=_sampling(LOOKUP)), plain)


def test_the_index_proposes_the_latest_match_longest_first_and_runs_on_loops():
    index = lookup.NgramIndex()
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    assert index.propose(3) == [4, 9, 2]  # "1 2 3" wins over "2 3" (last followed by 5)
    index.extend([4])
    assert index.propose(2) == [9, 2]
    latest = lookup.NgramIndex()
    latest.extend([5, 1, 2, 8, 6, 1, 2, 9, 7, 1, 2])
    assert latest.propose(2) == [9, 7]  # "1 2" as it went on last
    # A copy of a repetitive text stays on the match it follows: the latest "1 2 3 4"
    # went on with 31, the copied one with 30.
    copy = lookup.NgramIndex()
    copy.extend([10, 20, 1, 2, 3, 4, 30, 11, 21, 1, 2, 3, 4, 31, 10, 20])
    assert copy.propose(3) == [1, 2, 3]
    copy.extend([1, 2, 3, 4])
    assert copy.propose(2) == [30, 11]
    loop = lookup.NgramIndex()
    loop.extend([6, 8, 6, 8, 6])
    assert loop.propose(5) == [8, 6, 8, 6, 8]
    assert lookup.NgramIndex().propose(4) == []


def test_bad_values_and_a_draft_model_are_refused():
    model = loaded_test_model("dense")
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(prompt_lookup=33)
    with pytest.raises(DraftMismatch, match="one drafter"):
        Engine(model, TEST_CACHE, EngineConfig(prompt_lookup=4), draft=model)
    with _engine(model, PLAIN) as engine:
        with pytest.raises(InvalidRequest) as refused:
            engine.submit(PROMPT, SamplingParams(prompt_lookup=33))
        assert refused.value.param == "prompt_lookup"
    with contextlib.closing(_Shut(Engine(model, TEST_CACHE, draft=model))) as drafted:
        with pytest.raises(InvalidRequest) as refused:
            drafted.engine.submit(PROMPT, SamplingParams(prompt_lookup=4))
        assert refused.value.param == "prompt_lookup"


class _Shut:
    def __init__(self, engine: Engine):
        self.engine = engine

    def close(self) -> None:
        self.engine.shutdown()


def test_the_flag_its_variable_and_the_body_field(monkeypatch):
    args = build_parser().parse_args(["serve", "--prompt-lookup", "6"])
    assert engine_config(args).prompt_lookup == 6
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt-lookup", "40", "hi"])
    monkeypatch.setenv("MLX_PREFIX_ENGINE_PROMPT_LOOKUP", "5")
    assert engine_config(build_parser().parse_args(["serve"])).prompt_lookup == 5

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with serving() as (url, fake):
        bad = httpx.post(url + "/v1/chat/completions", json=body | {"prompt_lookup": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_lookup"
        ok = httpx.post(url + "/v1/chat/completions", json=body | {"prompt_lookup": 3})
        assert ok.status_code == 200, ok.text
        assert fake.submissions[-1].sampling.prompt_lookup == 3


def _together(engine: Engine, samplings: Sequence[SamplingParams]) -> list[Any]:
    handles = submit_together(engine, [PROMPT] * len(samplings), samplings)
    return [collect(h) for h in handles]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_several_requests_verify_their_own_drafts_in_one_step(verified_rows, deterministic):
    # A whole copy, a copy cut after three lines, and a reply whose drafts are all wrong:
    # rows of different lengths in one verify, each cut where its own reply goes.
    lines = FILE.split("\n")
    a, b = 1000, 1001
    scripts = {
        7: _tokens(FILE),
        8: _tokens("\n".join(lines[:3]) + "\nNothing else happened there, ever."),
        9: [t for i in range(16) for t in (a, b, 2000 + i)],
    }
    with scripted(scripts, deterministic=deterministic) as engine:
        plain = [run(engine, PROMPT, sampling=_sampling(PLAIN, seed=s)) for s in scripts]
        together = _together(engine, [_sampling(LOOKUP, seed=s) for s in scripts])
        assert engine.loop.decode.peak_batch == 3
    for looked, alone in zip(together, plain, strict=True):
        if deterministic:
            same_reply(looked, alone)
        else:  # the script draws the tokens; the numbers are batching's
            assert (looked.tokens, looked.text) == (alone.tokens, alone.text)
            assert looked.logprobs == pytest.approx(alone.logprobs, abs=1e-3)
    assert together[0].text == FILE
    # Several rows drafted in one forward, beside rows without a draft.
    assert any(sum(n > 0 for n in row) >= 2 for row in verified_rows)
    assert any(0 in row and any(row) for row in verified_rows)
    stats = engine.loop.decode.lookup.stats
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_requests_decoding_together_reply_as_plain_decoding_alone(temperature, verified_rows):
    model = loaded_test_model("dense")
    samplings = [
        SamplingParams(max_tokens=40, temperature=temperature, seed=s, logprobs=True)
        for s in (3, 4, 5)
    ]
    with _engine(model, PLAIN, deterministic=True) as engine:
        plain = [run(engine, PROMPT, sampling=s) for s in samplings]
    with _engine(model, LOOKUP, deterministic=True) as engine:
        together = _together(engine, samplings)
        assert engine.loop.decode.peak_batch == 3
    for looked, alone in zip(together, plain, strict=True):
        same_reply(looked, alone)
    if temperature == 0:  # the random model's greedy replies repeat themselves
        assert any(sum(n > 0 for n in row) >= 2 for row in verified_rows)


def test_by_default_a_verify_is_the_models_own_forward(monkeypatch):
    # Not --deterministic: the k+1 positions in one plain forward, as a batched step
    # computes (last bits may move); --deterministic keeps the exact per-position verify.
    calls = []
    per_position = verify_positions.verify_sdpa

    def counting(*args, **kwargs):
        calls.append(1)
        return per_position(*args, **kwargs)

    monkeypatch.setattr(verify_positions, "verify_sdpa", counting)
    for deterministic in (False, True):
        calls.clear()
        with scripted({7: _tokens(FILE)}, deterministic=deterministic) as engine:
            plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
            looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
            accepted = engine.loop.decode.lookup.stats.accepted
        # The script draws the tokens: the same whatever the last bits.
        assert (looked.tokens, looked.text) == (plain.tokens, plain.text) and accepted > 0
        assert looked.logprobs == pytest.approx(plain.logprobs, abs=1e-3)
        assert bool(calls) == deterministic
        if deterministic:
            assert looked.logprobs == plain.logprobs


EXAMPLE = '{"name": "Ann", "age": 40, "tags": ["red", "blue"], "member": true}'
TOOL_CALL = json.dumps(
    {"name": "edit", "arguments": {"path": "harbour.txt", "old_string": FILE, "new_string": ""}}
)


def test_a_tool_call_and_a_schema_reply_verify_together_as_plain_decoding(verified_rows):
    # One request's reply is an edit tool call repeating the file (scripted); the other
    # is held to a JSON schema by its constraint while it drafts from a JSON example in
    # its prompt: a constrained row's drafts are drawn through its mask, in order.
    edit = chat(("system", "Tools: edit(path, old_string, new_string)."), ("user", PROMPT_TEXT))
    person = chat(("system", f"People are JSON objects like {EXAMPLE} " * 3), ("user", "Ann?"))
    schema = SamplingParams(
        max_tokens=80, temperature=1.0, seed=5, logprobs=True, response_format=AS_PERSON
    )
    tool = _sampling(PLAIN)
    with scripted({7: _tokens(f"<tool_call>\n{TOOL_CALL}\n</tool_call>")}) as engine:
        plain = [run(engine, p, sampling=s) for p, s in ((edit, tool), (person, schema))]
        looked_up = [replace(s, prompt_lookup=LOOKUP) for s in (tool, schema)]
        together = [collect(h) for h in submit_together(engine, [edit, person], looked_up)]
    for looked, alone in zip(together, plain, strict=True):
        same_reply(looked, alone)
    assert json.loads(together[0].text.split("\n")[1]) == json.loads(TOOL_CALL)
    check_person(together[1].text)
    assert any(len(row) == 2 and row[1] > 0 for row in verified_rows)  # the schema drafted
    assert engine.loop.decode.lookup.stats.accepted > 0


def test_a_request_cancelled_during_a_verify_of_several_leaves_the_others_exact(monkeypatch):
    verify_rows = DecodeBatch.verify_rows

    def cancelling(self, rows):
        logits = verify_rows(self, rows)
        for member in self.members:
            if isinstance(member, Running) and member.job.sampling.seed == 8:
                member.job.handle.cancel()  # as a client's disconnect, mid-verify
        return logits

    scripts = {7: _tokens(FILE), 8: _tokens(FILE.replace("grey", "red"))}
    with scripted(scripts) as engine:
        plain = [run(engine, PROMPT, sampling=_sampling(PLAIN, seed=s)) for s in scripts]
        monkeypatch.setattr(DecodeBatch, "verify_rows", cancelling)
        kept, cancelled = _together(engine, [_sampling(LOOKUP, seed=s) for s in scripts])
        assert engine.loop.decode.peak_batch == 2
    assert cancelled.finish_reason == "cancelled"
    assert cancelled.tokens == plain[1].tokens[: len(cancelled.tokens)]
    same_reply(kept, plain[0])


def test_where_the_verify_is_not_exact_nobody_drafts_and_steps_overlap(monkeypatch):
    # --deterministic's startup check failed (a model whose layers bypass the exact
    # verify): lookup never drafts, so a copy that would draft costs no overlapped step.
    monkeypatch.setattr(lookup, "verify_matches", lambda *args: False)
    with scripted({7: CHANCE, 8: _tokens(FILE)}) as engine:
        decode = engine.loop.decode
        plain = [run(engine, PROMPT, sampling=_sampling(PLAIN, seed=s)) for s in (7, 8)]
        assert decode.lookup.exact is False  # checked at startup
        decode.pipelined = True  # a GPU's default; the CPU's async_eval blocks (phase.py)
        decode.overlapped = 0
        copy = _together(engine, [_sampling(None, seed=8), _sampling(None, seed=7)])
        assert decode.peak_batch == 2 and decode.lookup.stats.steps == 0
        assert decode.overlapped > len(copy[0].tokens) // 2
    same_reply(copy[0], plain[1])
    same_reply(copy[1], plain[0])
