"""Structured output (issue 18, item 2): a response format holds the reply to JSON, or
to a JSON schema, on random-weight models that would never write JSON by themselves;
without changing the cache's promise (a hit answers as a cold run) or the replies of
requests decoding beside it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from support.engine_helpers import chat, run, submit_together
from support.structured import AS_PERSON, check_person
from test_engine_batch import collect

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import ResponseFormat, SamplingParams

PROMPT = chat(
    ("system", "You describe people as JSON objects with a name, age, tags and member. " * 4),
    ("user", "Describe the lighthouse keeper."),
)
SEEDED = SamplingParams(max_tokens=80, temperature=1.0, seed=5, response_format=AS_PERSON)


def test_fifty_seeded_requests_decoding_together_all_follow_the_schema(make_engine):
    engine = make_engine("dense")
    handles = submit_together(engine, [PROMPT] * 50, [replace(SEEDED, seed=s) for s in range(50)])
    people = []
    for handle in handles:
        tokens, done = collect(handle)
        assert done.finish_reason == "stop"  # the schema closed, EOS allowed only then
        people.append(check_person(engine.model.tokenizer.decode(tokens)))
    assert engine.loop.decode.peak_batch > 1
    assert len({json.dumps(p) for p in people}) > 40  # sampled, not one forced reply
    assert engine.constraints.compiles == 1  # one schema, compiled once


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_cache_hit_gives_the_cold_reply_under_a_schema(make_engine, kind):
    engine = make_engine(kind)
    run(engine, PROMPT, sampling=replace(SEEDED, seed=1))  # caches the prompt
    warm = run(engine, PROMPT, sampling=SEEDED)
    cold = run(engine, PROMPT, sampling=SEEDED, cache=False)
    assert warm.usage.cached_tokens > 0 and cold.usage.cached_tokens == 0
    assert warm.tokens == cold.tokens
    check_person(warm.text)


def test_a_constrained_request_leaves_its_neighbours_reply_unchanged(make_engine):
    engine = make_engine("dense", deterministic=True)  # batched == alone, by construction
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=9)
    other = chat(("user", "Write about the sea."))
    alone = run(engine, other, sampling=free).tokens
    constrained, beside = submit_together(engine, [PROMPT, other], [SEEDED, free])
    person_tokens, _ = collect(constrained)
    assert collect(beside)[0] == alone
    assert engine.loop.decode.peak_batch == 2
    check_person(engine.model.tokenizer.decode(person_tokens))
    assert not _is_json(engine.model.tokenizer.decode(alone))  # the mask did not leak


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_json_object_mode_gives_an_object(make_engine):
    # Any object: a random model could write one key forever, so closing tokens get a
    # push (the constraint still decides which of them may come).
    engine = make_engine("dense")
    tokenizer = engine.model.tokenizer
    closers = [tokenizer.encode(s)[0] for s in ('"', "}", '"}', '",', '":')]
    for seed in range(3):
        sampling = SamplingParams(
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=ResponseFormat("json_object"),
            logit_bias=tuple((t, 10.0) for t in closers),
        )
        reply = run(engine, PROMPT, sampling=sampling)
        assert reply.finish_reason == "stop"
        assert isinstance(json.loads(reply.text), dict), reply.text


def test_without_a_format_the_same_request_writes_no_json(make_engine):
    engine = make_engine("dense")
    free = run(engine, PROMPT, sampling=replace(SEEDED, response_format=None))
    assert not _is_json(free.text)  # so the format above is what made it JSON


@pytest.mark.parametrize(
    "schema",
    ['{"type": "objekt"}', '{"$ref": "#/missing"}', '{"type": "string", "pattern": "(?<=a)b"}'],
)
def test_a_schema_that_cannot_be_compiled_is_refused_naming_the_field(make_engine, schema):
    engine = make_engine("dense")
    fmt = ResponseFormat("json_schema", schema, param="response_format.json_schema.schema")
    with pytest.raises(InvalidRequest) as info:
        engine.submit(PROMPT, replace(SEEDED, response_format=fmt))
    assert info.value.param == "response_format.json_schema.schema"
    assert "JSON schema" in info.value.message
