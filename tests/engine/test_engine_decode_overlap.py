"""Overlapped decode steps (DecodeBatch.step with `overlap`): the next step is launched
with the previous step's tokens still lazy, as mlx_lm.generate pipelines, so a step's
graph is built while the one before computes. What it must never change: the tokens,
their logprobs, a reply's length, and what a row needing its newest token on the host
(a constraint's mask) samples."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.engine_helpers import chat, collect, run, submit_together
from support.models import loaded_test_model
from support.structured import check_person
from test_engine_structured import PROMPT, SEEDED

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.records import CachePreference, SamplingParams

PROMPTS = [[(7 * i + j) % 200 + 10 for j in range(30 + 7 * i)] for i in range(4)]
WITH_LOGPROBS = SamplingParams(temperature=0.0, logprobs=True)


def _prefilled(model, tokens):
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
    return cache, int(mx.argmax(logits, axis=-1).item())


def _batch(model, prompts, rows=None) -> DecodeBatch:
    batch = DecodeBatch(model, rows)
    for i, tokens in enumerate(prompts):
        cache, first = _prefilled(model, tokens)
        batch.add(i, cache, TokenSampler(WITH_LOGPROBS), first, steps=8)
    return batch


def _rows(read) -> dict[int, list[tuple[int, float]]]:
    out: dict[int, list[tuple[int, float]]] = {}
    for member, sample in read:
        out.setdefault(member, []).append((sample.token, sample.logprob))
    return out


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_overlapped_steps_read_one_call_late_and_compute_the_same_tokens(kind):
    """The same rows stepped six times, waiting for each step or overlapping them: the
    first overlapped call returns nothing, each later one the step launched before it, and
    `read_launched` the last one; tokens and logprobs are bit for bit equal."""
    model = loaded_test_model(kind).model
    waited = _batch(model, PROMPTS[:3])
    expected: list = []
    for _ in range(6):
        expected += waited.step(want_logprobs=True)

    overlapped = _batch(model, PROMPTS[:3])
    assert overlapped.step(want_logprobs=True, overlap=True) == []
    assert overlapped.launched
    got: list = []
    for _ in range(5):
        got += overlapped.step(want_logprobs=True, overlap=True)
    assert overlapped.launched
    got += overlapped.read_launched()  # the sixth; nothing launches
    assert not overlapped.launched
    assert _rows(got) == _rows(expected)
    assert all(len(tokens) == 6 for tokens in _rows(got).values())


def test_rows_leaving_and_joining_while_a_step_computes_answer_as_alone():
    """Batch-invariant rows (--deterministic), so each row's tokens are its alone run's:
    a row leaves while the step holding its next token computes (that token is dropped),
    and a row joins while a step computes without it. The rows' tokens are those of each
    decoding alone."""
    model = loaded_test_model("dense").model
    rowwise.install(model)
    rows = rowwise.consistent_rows(model)
    alone = {}
    for i, tokens in enumerate(PROMPTS):
        one = _batch(model, [tokens], rows)
        alone[i] = [s.token for _ in range(8) for _, s in one.step()]

    batch = DecodeBatch(model, rows)
    for i in (0, 1, 2):
        cache, first = _prefilled(model, PROMPTS[i])
        batch.add(i, cache, TokenSampler(WITH_LOGPROBS), first, steps=8)
    got: dict[int, list[int]] = {i: [] for i in alone}

    def step():
        for member, sample in batch.step(overlap=True):
            got[member].append(sample.token)

    step()
    step()
    step()  # rows 0-2 have read two tokens; their third computes
    assert batch.in_flight(1)
    batch.remove([1])  # leaves with its third token in flight
    cache, first = _prefilled(model, PROMPTS[3])
    batch.add(3, cache, TokenSampler(WITH_LOGPROBS), first, steps=8)
    assert batch.in_flight(1) and not batch.in_flight(2)  # rows 0 and 2 are, the joiner not
    for _ in range(4):
        step()
    for member, sample in batch.read_launched():
        got[member].append(sample.token)
    # Rows 0 and 2: two tokens, then one per call; the joiner's first step launched
    # at the fourth call, so three came back late and the last read brought its fourth.
    assert got == {0: alone[0][:7], 1: alone[1][:2], 2: alone[2][:7], 3: alone[3][:4]}


def test_the_engine_overlaps_steps_and_replies_keep_their_lengths_and_answers(make_engine):
    """Batch-invariant engine: replies of different lengths decode together, their rows
    leaving one by one while steps are in flight, and one more request joins midway.
    Every reply has exactly its max_tokens and is its alone run's; steps overlapped."""
    engine = make_engine("dense", deterministic=True)
    engine.loop.decode.pipelined = True  # a GPU's default; the CPU's async_eval blocks (phase.py)
    eos = sorted(engine.model.tokenizer.eos_token_ids)
    never_ends = tuple((t, -1e9) for t in eos)
    prompts = [chat(("user", f"Say something about {w}.")) for w in ("tea", "rain", "ink", "oak")]
    samplings = [
        SamplingParams(max_tokens=n, temperature=0.0, logit_bias=never_ends) for n in (5, 9, 14, 7)
    ]
    alone = [
        run(engine, p, sampling=s, cache=False).tokens
        for p, s in zip(prompts, samplings, strict=True)
    ]
    engine.loop.decode.overlapped = 0
    off = [CachePreference(enabled=False)] * 3
    handles = submit_together(engine, prompts[:3], samplings[:3], off)
    first = collect(handles[0])
    late = engine.submit(prompts[3], samplings[3], CachePreference(enabled=False))
    results = [first, *(collect(h) for h in (*handles[1:], late))]
    for result, sampling, expected in zip(results, samplings, alone, strict=True):
        assert result.finish_reason == "length"
        assert len(result.tokens) == sampling.max_tokens
        assert result.tokens == expected
    assert engine.loop.decode.overlapped > 0
    assert engine.loop.decode.peak_batch >= 2


def test_only_a_device_that_computes_asynchronously_pipelines_by_default(make_engine):
    engine = make_engine("dense")
    assert engine.loop.decode.pipelined == (mx.default_device() != mx.cpu)
    run(engine, chat(("user", "Hello.")), sampling=SamplingParams(max_tokens=4))
    assert (engine.loop.decode.overlapped > 0) == engine.loop.decode.pipelined


def test_a_constrained_row_waits_for_each_token(make_engine):
    """A constraint masks each step by the token before it, so its row never overlaps;
    the schema still holds. An unconstrained request does overlap."""
    engine = make_engine("dense")
    engine.loop.decode.pipelined = True
    person = run(engine, PROMPT, sampling=SEEDED)
    check_person(person.text)
    assert engine.loop.decode.overlapped == 0
    run(engine, PROMPT, sampling=replace(SEEDED, response_format=None, max_tokens=6))
    assert engine.loop.decode.overlapped > 0
