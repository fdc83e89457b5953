"""The official `anthropic` SDK against a live server backed by the fake engine: message
shapes, the streaming event sequence, tools, count_tokens and errors."""

from __future__ import annotations

import json
from dataclasses import replace

import anthropic
import httpx
import pytest
from support.live import anthropic_client, live_server, tool_calling_engine
from support.server_fakes import DEFAULT_REPLY, FakeTokenizer, serving

from mlx_prefix.conversation import Message
from mlx_prefix.prompt.reply.reader import ReplyFormat
from mlx_prefix.records import TokenEvent, ToolCallIds
from mlx_prefix.server.protocol.anthropic.bodies import parse_messages_request
from mlx_prefix.server.protocol.request import Limits
from mlx_prefix.server.replies.assembler import Assembler

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 3
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


live = live_server(tool_calling_engine)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_returns_a_message(claude):
    m = claude.messages.create(
        model="claude-local", max_tokens=64, system=SYSTEM, messages=user("opening hours?")
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == "fake-model"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == DEFAULT_REPLY
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    u = m.usage
    assert u.output_tokens == len(DEFAULT_REPLY.split())
    total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert (
        total
        == claude.messages.count_tokens(
            model="x", system=SYSTEM, messages=user("opening hours?")
        ).input_tokens
    )


def test_second_turn_reads_its_prefix_from_the_cache(claude):
    first = claude.messages.create(
        model="m", max_tokens=64, system=SYSTEM, messages=user("Where are the atlases?")
    )
    turns = [
        *user("Where are the atlases?"),
        {"role": "assistant", "content": first.content[0].text},
        *user("And the maps?"),
    ]
    second = claude.messages.create(model="m", max_tokens=64, system=SYSTEM, messages=turns)
    assert second.usage.cache_read_input_tokens > 40
    cold = claude.messages.create(
        model="m",
        max_tokens=64,
        system=SYSTEM,
        messages=turns,
        extra_body={"prefix_cache": {"enabled": False}},
    )
    assert cold.usage.cache_read_input_tokens == 0
    assert cold.usage.cache_creation_input_tokens == 0
    assert second.content == cold.content


def test_stream_event_sequence_and_final_message(claude, live):
    with claude.messages.stream(
        model="m", max_tokens=64, system=SYSTEM, messages=user("stream please")
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == DEFAULT_REPLY == final.content[0].text
    assert final.stop_reason == "end_turn"
    # The raw wire: the SDKs need `event:` lines and this order.
    body = {"model": "m", "max_tokens": 64, "messages": user("raw stream"), "stream": True}
    r = httpx.post(f"{live[0]}/v1/messages?beta=true", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in datas] == events
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = datas[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert set(start["usage"]) == {
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
    }
    assert datas[-2]["usage"]["output_tokens"] == len(DEFAULT_REPLY.split())


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_blocks_and_tool_result_round_trip(claude, engine, stream):
    ask = user(f"Weather in Paris? [[reply:Let me check. {CALL}]]")
    if stream:
        with claude.messages.stream(model="m", max_tokens=64, tools=[WEATHER], messages=ask) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(model="m", max_tokens=64, tools=[WEATHER], messages=ask)
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == "Let me check. "
    call = m.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert m.stop_reason == "tool_use"
    turns = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C, sunny"}],
        },
    ]
    again = claude.messages.create(model="m", max_tokens=64, tools=[WEATHER], messages=turns)
    sent = engine.submissions[-1].prompt.messages
    assert sent[1].tool_calls[0].id == call.id
    assert sent[2] == Message("tool", "18C, sunny", tool_call_id=call.id, name="get_weather")
    assert again.usage.cache_read_input_tokens > 0


def test_forced_tool_choice_opens_the_call(claude, engine):
    body = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    m = claude.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=user(f"Weather? [[reply:{body}</tool_call>]]"),
    )
    assert engine.submissions[-1].prompt.assistant_prefix == "<tool_call>"
    assert [b.type for b in m.content] == ["tool_use"] and m.content[0].input == {"city": "Oslo"}
    assert m.stop_reason == "tool_use"
    args = '{"city": "Rome"}}\n</tool_call>'
    named = claude.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=user(f"Weather? [[reply:{args}]]"),
    )
    prefix = engine.submissions[-1].prompt.assistant_prefix
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert named.content[0].name == "get_weather" and named.content[0].input == {"city": "Rome"}


def test_disable_parallel_tool_use_ends_after_the_first_call(claude):
    two = CALL + CALL.replace("Paris", "Lyon")
    m = claude.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        messages=user(f"Both? [[reply:{two}]]"),
    )
    assert [b.input for b in m.content if b.type == "tool_use"] == [{"city": "Paris"}]
    assert m.stop_reason == "tool_use"


def test_thinking_text_and_whitespace_blocks(claude, engine):
    reply = f"<think>The user wants weather.</think>\n\n{CALL}"
    m = claude.messages.create(
        model="m", max_tokens=64, tools=[WEATHER], messages=user(f"w [[reply:{reply}]]")
    )
    assert [b.type for b in m.content] == ["thinking", "tool_use"]  # no whitespace text block
    assert m.content[0].thinking == "The user wants weather." and m.content[0].signature == ""
    omitted = claude.messages.create(
        model="m",
        max_tokens=64,
        thinking={"type": "adaptive", "display": "omitted"},
        messages=user("x [[reply:<think>hidden</think>Shown.]]"),
    )
    # Omitted as Anthropic omits it: an empty thinking block whose signature carries the
    # reasoning back on the next turn (the template renders what the model wrote).
    assert [b.type for b in omitted.content] == ["thinking", "text"]
    assert omitted.content[0].thinking == "" and omitted.content[1].text == "Shown."
    with claude.messages.stream(
        model="m",
        max_tokens=64,
        thinking={"type": "adaptive", "display": "omitted"},
        messages=user("x [[reply:<think>hidden</think>Shown.]]"),
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "thinking_delta" not in kinds and "signature_delta" in kinds
    assert streamed.content[0].model_dump() == omitted.content[0].model_dump()
    back = [
        *user("x"),
        {"role": "assistant", "content": [b.model_dump() for b in omitted.content]},
        *user("again"),
    ]
    claude.messages.create(model="m", max_tokens=8, messages=back)
    sent = engine.submissions[-1].prompt.messages
    assert sent[1] == Message("assistant", "Shown.", reasoning="hidden")


def test_stop_reasons(claude):
    stopped = claude.messages.create(
        model="m",
        max_tokens=64,
        stop_sequences=["three"],
        messages=user("[[reply:one two three four]]"),
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "three"
    assert stopped.content[0].text == "one two "
    cut = claude.messages.create(model="m", max_tokens=2, messages=user("[[reply:one two three]]"))
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_count_tokens(claude, engine):
    n = claude.messages.count_tokens(model="m", system=SYSTEM, messages=user("count"))
    assert n.input_tokens == len((SYSTEM + " count").split()) + 3  # the fake's role markers


def test_errors_in_anthropic_shape_and_the_server_keeps_serving(claude, live):
    url = live[0]
    cases = {
        "missing max_tokens": {"model": "m", "messages": user("hi")},
        "unknown block type": {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [{"type": "hologram"}]}],
        },
        "tool_result without a tool_use": {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "x"}],
                }
            ],
        },
        "not json": None,
    }
    for name, body in cases.items():
        r = (
            httpx.post(
                f"{url}/v1/messages", content=b"{nope", headers={"content-type": "application/json"}
            )
            if body is None
            else httpx.post(f"{url}/v1/messages", json=body)
        )
        assert r.status_code == 400, name
        assert r.json()["type"] == "error", name
        assert r.json()["error"]["type"] == "invalid_request_error", name
        assert r.json()["error"]["message"], name
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "hologram"}]}],  # type: ignore[list-item]
        )
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.get("/v1/nothing", cast_to=object)
    m = claude.messages.create(model="m", max_tokens=8, messages=user("still there?"))
    assert m.content[0].text


def test_a_failure_mid_stream_is_an_error_event(claude):
    with pytest.raises(anthropic.APIStatusError) as err:
        with claude.messages.stream(
            model="m", max_tokens=64, messages=user("[[fail_after:2]]")
        ) as stream:
            for _ in stream:
                pass
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "api_error"


def test_x_api_key_as_the_sdk_sends_it():
    with serving(api_key="sekrit") as (url, _):
        with anthropic_client(url, api_key="sekrit") as ok:
            assert ok.messages.create(model="m", max_tokens=8, messages=user("k")).content
        with anthropic_client(url, api_key="wrong") as bad:
            with pytest.raises(anthropic.AuthenticationError) as err:
                bad.messages.create(model="m", max_tokens=8, messages=user("k"))
    assert err.value.body["error"]["type"] == "authentication_error"


def test_statuses_map_to_anthropic_error_types():
    with serving(max_body_bytes=4096) as (url, _):
        big = {"model": "m", "max_tokens": 8, "messages": user("x" * 8000)}
        r = httpx.post(f"{url}/v1/messages", json=big)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        busy = {"model": "m", "max_tokens": 8, "messages": user("[[busy]]")}
        r = httpx.post(f"{url}/messages", json=busy)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        crash = {"model": "m", "max_tokens": 8, "messages": user("[[crash]]")}
        r = httpx.post(f"{url}/v1/messages", json=crash)
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        r = httpx.get(f"{url}/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = httpx.post(f"{url}/v1/messages", json=big, headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_text_and_calls_split_alike_whatever_the_deltas(step):
    reply = f"<think>\nCheck Paris.\n</think>\n\nLooking.\n{CALL}\n{CALL}\n"
    body = {"model": "m", "max_tokens": 9, "tools": [WEATHER], "messages": user("Weather?")}
    req = parse_messages_request(body, Limits(8, 64)).generation
    ids = ToolCallIds("msg_1", prefix="toolu_")
    req = replace(req, prompt=replace(req.prompt, reply_tool_call_ids=ids))
    tokenizer = FakeTokenizer.with_json_tools()
    assembler = Assembler.for_request(req, ReplyFormat.of(tokenizer), tokenizer, streaming=False)
    pieces = [reply[i : i + step] for i in range(0, len(reply), step)]
    deltas = [assembler.feed(TokenEvent(piece, None)) for piece in pieces]
    deltas.append(assembler.finish())
    assert "".join(d.reasoning for d in deltas) == "\nCheck Paris.\n"
    # The newlines after the end marker, between the calls and after them are dropped.
    assert "".join(d.text for d in deltas) == "Looking.\n"
    calls = [c for d in deltas for c in d.tool_calls]
    assert [c["id"] for c in calls] == [ids.id(0), ids.id(1)]
