"""Issue 18 over HTTP, real engine, official openai client: `response_format` (chat) and
`text.format` (Responses) give replies that parse and follow the schema, streamed or
not, warm or cold; mlx_lm.server's sampling fields are honoured on chat and completions;
what cannot be honoured is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from support.live import live_server
from support.models import TEST_CACHE, loaded_test_model
from support.structured import PERSON, check_person

from mlx_prefix.engine.engine import Engine
from mlx_prefix.server.protocol.chat import parse_chat
from mlx_prefix.server.protocol.completions import parse_completion
from mlx_prefix.server.protocol.request import Limits

SYSTEM = "You describe people as JSON objects with a name, age, tags and member. " * 4
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Describe the lighthouse keeper."},
]
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
COLD = {"prefix_cache": {"enabled": False}}


live = live_server(lambda: Engine(loaded_test_model("dense"), TEST_CACHE))


def person_chat(client, seed: int = 3, **extra):
    return client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=80,
        temperature=1.0,
        seed=seed,
        response_format=CHAT_FORMAT,
        **extra,
    )


def test_chat_json_schema_replies_follow_the_schema_warm_as_cold(client):
    person_chat(client, seed=1)  # caches the prompt
    warm = person_chat(client)
    cold = person_chat(client, extra_body=COLD)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.choices[0].finish_reason == "stop"
    check_person(warm.choices[0].message.content)


def test_chat_json_schema_streams_the_same_reply(client):
    whole = person_chat(client).choices[0].message.content
    chunks = list(person_chat(client, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    check_person(streamed)


def test_chat_json_object_and_completions_response_format(client):
    closers = {str(t): 10 for t in (18, 109, 23597)}  # '"', '}', '"}' in the test tokenizer
    reply = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias=closers,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    done = client.completions.create(
        model="default",
        prompt="A person as JSON:",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": CHAT_FORMAT},
    )
    check_person(done.choices[0].text)


def test_responses_text_format_follows_the_schema_streamed_or_not(client):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    kwargs = {"model": "default", "instructions": SYSTEM, "input": "Describe the keeper."}
    r = client.responses.create(**kwargs, max_output_tokens=80, text=text, store=False)
    check_person(r.output_text)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    events = list(
        client.responses.create(**kwargs, max_output_tokens=80, text=text, stream=True, store=False)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text


@pytest.mark.parametrize("where", ["output_format", "output_config"])
def test_messages_output_format_follows_the_schema(url, where):
    """Anthropic's structured outputs: the beta's `output_format`, and the GA's
    `output_config.format`, held to the schema like chat's response_format."""
    fmt = {"type": "json_schema", "schema": PERSON}
    body = {
        "model": "default",
        "system": SYSTEM,
        "messages": MESSAGES[1:],
        "max_tokens": 80,
        "seed": 3,
        **(
            {"output_format": fmt}
            if where == "output_format"
            else {"output_config": {"format": fmt}}
        ),
    }
    r = httpx.post(f"{url}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["stop_reason"] == "end_turn"
    check_person("".join(b["text"] for b in reply["content"] if b["type"] == "text"))


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            "/v1/chat/completions",
            {
                "response_format": {"type": "json_object"},
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            },
            "response_format",
        ),
        (
            "/v1/responses",
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/no"}}}},
            "text.format.schema",
        ),
        ("/v1/chat/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"ten": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"10": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"top_k": -1}, "top_k"),
        ("/v1/completions", {"min_p": 2}, "min_p"),
        ("/v1/completions", {"xtc_threshold": 0.6}, "xtc_threshold"),
        ("/v1/completions", {"repetition_context_size": 0}, "repetition_context_size"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(url, path, body, param):
    base = (
        {"input": "hi"}
        if path == "/v1/responses"
        else {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": MESSAGES}
    )
    limit = {"max_output_tokens" if path == "/v1/responses" else "max_tokens": 4}
    r = httpx.post(f"{url}{path}", json={"model": "default", **base, **body, **limit})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_sampling_fields_are_honoured_over_http(client, kind):
    tokenizer = loaded_test_model("dense").tokenizer

    def reply(**extra) -> tuple[str, int]:
        """The reply's text and its first token's id."""
        if kind == "chat":
            r = client.chat.completions.create(
                model="default", messages=MESSAGES, max_tokens=10, logprobs=True, extra_body=extra
            )
            text, first = r.choices[0].message.content, r.choices[0].logprobs.content[0].token
        else:
            r = client.completions.create(
                model="default",
                prompt="The keeper said",
                max_tokens=10,
                logprobs=0,
                extra_body=extra,
            )
            text, first = r.choices[0].text, r.choices[0].logprobs.tokens[0]
        (token,) = tokenizer.encode(first)
        return text, token

    greedy, first = reply(temperature=0)
    hot = {"temperature": 1.5, "seed": 4}
    assert reply(**hot)[0] != greedy
    assert reply(**hot, top_k=1)[0] == greedy
    assert reply(**hot, min_p=1.0)[0] == greedy
    assert reply(temperature=0, logit_bias={str(first): -100})[1] != first
    assert reply(temperature=0, logit_bias={"1234": 100})[1] == 1234
    # (presence_penalty's most, 2, does not outweigh this model's lead for its token:
    # the engine tests show it at work, the test below that it reaches the engine.)
    for penalty in ({"repetition_penalty": 1.5}, {"frequency_penalty": 2.0}):
        assert reply(temperature=0, **penalty)[0] != greedy, penalty
    assert reply(**hot, xtc_probability=1.0, xtc_threshold=0.0005)[0] != reply(**hot)[0]


FIELDS = {
    "top_k": 7,
    "min_p": 0.2,
    "xtc_probability": 0.3,
    "xtc_threshold": 0.2,
    "repetition_penalty": 1.2,
    "repetition_context_size": 30,
    "presence_penalty": -1.5,
    "presence_context_size": 40,
    "frequency_penalty": 0.5,
    "frequency_context_size": 50,
}


def test_every_sampling_field_reaches_the_engine_from_chat_and_completions():
    limits = Limits(default_max_tokens=16, max_tokens=1000)
    extra = {**FIELDS, "logit_bias": {"5": -100, "17": 2.5}}
    for req in (
        parse_chat({"messages": MESSAGES, **extra}, limits),
        parse_completion({"prompt": "hi", **extra}, limits),
    ):
        assert {name: getattr(req.sampling, name) for name in FIELDS} == FIELDS
        assert req.sampling.logit_bias == ((5, -100.0), (17, 2.5))
