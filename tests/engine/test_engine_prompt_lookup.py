"""Prompt lookup decoding (engine/decode/lookup.py): drafts from the request's own
sequence, verified in one forward; the reply is plain decoding's, tokens and logprobs,
whether the drafts are all kept, all rejected or cut mid-way. Scripted samplers make
the replies copy (the tiny models' weights are random): what they draw is fixed, and
the logprobs each row reports are the model's own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
import pytest
from support.engine_helpers import ScriptedSampler, chat, run
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.cli import build_parser
from mlx_prefix.cli.args import engine_config
from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.decode import lookup
from mlx_prefix.engine.decode import phase as decode
from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.decode.speculative import DraftMismatch
from mlx_prefix.engine.engine import Engine
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
PROMPT = chat(("user", f"Repeat this file exactly:\n{FILE}"))
LOOKUP, PLAIN = 8, 0  # a request's prompt_lookup


def _sampling(lookup: int, seed: int = 7, **extra: Any) -> SamplingParams:
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
        patch.setattr(decode, "TokenSampler", sampler)
        engine = Engine(model, TEST_CACHE, EngineConfig(deterministic=True, **config))
        try:
            yield engine
        finally:
            engine.shutdown()


def _tokens(text: str) -> list[int]:
    return loaded_test_model("dense").tokenizer.encode(text, add_special_tokens=False)


def _same(a, b) -> None:
    assert (a.tokens, a.logprobs, a.text, a.finish_reason) == (
        b.tokens,
        b.logprobs,
        b.text,
        b.finish_reason,
    )


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
        assert engine.lookup.steps == 0  # 0: plain decoding
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
    _same(looked, plain)
    assert looked.text == FILE and looked.finish_reason == "stop"
    assert engine.lookup.steps == len(verifies) < len(looked.tokens) // 3
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
    _same(looked, plain)
    stats = engine.lookup
    assert 0 < stats.accepted < stats.drafted


def test_drafts_all_rejected_back_off_and_the_reply_stays_exact():
    # "A B x1 A B x2 ...": each "A B" was last followed by another x, so every draft
    # is wrong at its first token.
    a, b, cycles = 1000, 1001, 24
    script = [t for i in range(cycles) for t in (a, b, 2000 + i)]
    with scripted({7: script}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP))
    _same(looked, plain)
    assert looked.tokens == script
    stats = engine.lookup
    assert stats.drafted > 0 and stats.accepted == 0
    # k halved to 0 and the request paused: fewer verifies than drafting chances.
    assert stats.steps < cycles // 2


def test_a_stop_string_inside_an_accepted_draft_ends_the_reply_there():
    stop = ("Quay Street",)
    with scripted({7: _tokens(FILE)}) as engine:
        plain = run(engine, PROMPT, sampling=_sampling(PLAIN, stop=stop))
        looked = run(engine, PROMPT, sampling=_sampling(LOOKUP, stop=stop))
    _same(looked, plain)
    assert looked.finish_reason == "stop" and looked.text.endswith(
        "Storms in autumn broke windows along "
    )
    assert engine.lookup.accepted > 0


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
            stats.append(engine.lookup)
    _same(replies[1], replies[0])
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
        assert cancelled.finish_reason == "cancelled" and engine.lookup.steps == 1
        assert cancelled.tokens == plain.tokens[: len(cancelled.tokens)]
        _same(run(engine, PROMPT, sampling=_sampling(LOOKUP)), plain)


def test_a_hybrid_model_and_a_batch_decode_plainly():
    hybrid = loaded_test_model("qwen3_5")
    sampling = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True)
    with _engine(hybrid, LOOKUP) as on, _engine(hybrid, PLAIN) as off:
        _same(run(on, PROMPT, sampling=sampling), run(off, PROMPT, sampling=sampling))
        assert on.lookup.steps == 0  # its recurrent state cannot take a draft back (yet)


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
