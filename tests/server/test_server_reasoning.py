"""Reasoning on every API family, with the fake engine: a prompt that leaves a think block
open (`[[think]]`) starts its reply as reasoning; markup written while reasoning is no
call; reasoning sent back reaches the template's `reasoning_content`; effort and budget
fields are honoured (mapped to a budget and the template's switch) or refused."""

from __future__ import annotations

import openai
import pytest
from support.live import live_server, tool_calling_engine

from mlx_prefix.conversation import template_messages
from mlx_prefix.server.protocol.messages import conversation_from_dicts

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
# Reasoning (with call markup inside) the prompt opened, then the answer.
REPLY = f"Maybe {CALL} would help.</think>\n\nIt is sunny."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


live = live_server(tool_calling_engine)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": f"{text} [[think]] [[reply:{REPLY}]]"}]


def test_chat_reply_starts_as_reasoning_and_its_markup_is_no_call(client):
    r = client.chat.completions.create(model="m", messages=ask("Weather?"), tools=[WEATHER])
    message = r.choices[0].message
    assert message.content == "It is sunny." and not message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    extra = message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == f"Maybe {CALL} would help."
    stream = client.chat.completions.create(
        model="m", messages=ask("Weather?"), tools=[WEATHER], stream=True
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == (
        f"Maybe {CALL} would help."
    )
    assert "".join(d.content or "" for d in deltas) == "It is sunny."
    assert not any(d.tool_calls for d in deltas)


def test_messages_reply_starts_as_a_thinking_block(claude):
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    m = claude.messages.create(model="m", max_tokens=64, tools=[tool], messages=ask("W?"))
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == f"Maybe {CALL} would help."
    assert m.stop_reason == "end_turn"


def test_responses_reply_has_a_reasoning_item(client, engine):
    r = client.responses.create(
        model="m", input=ask("Weather?"), tools=[{"type": "function", "name": "get_weather"}]
    )
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == f"Maybe {CALL} would help."
    assert r.output[0].summary == [] and r.output_text == "It is sunny."
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(
        model="m", input=ask("Weather?"), tools=[{"type": "function", "name": "get_weather"}]
    ) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert [i.type for i in streamed.output] == ["reasoning", "message"]
    assert streamed.output[0].model_dump(exclude={"id"}) == r.output[0].model_dump(exclude={"id"})
    assert streamed.output_text == r.output_text
    # Sent back (or chained by id), the reasoning reaches the template.
    client.responses.create(
        model="m",
        input=[
            *ask("Weather?"),
            *[i.model_dump() for i in r.output],
            {"role": "user", "content": "ok"},
        ],
    )
    sent = engine.submissions[-1].prompt.messages
    assert sent[1].reasoning == f"Maybe {CALL} would help."
    assert sent[1].content == "It is sunny."
    client.responses.create(model="m", input="more", previous_response_id=r.id)
    assert engine.submissions[-1].prompt.messages[1] == sent[1]
    # Codex sends reasoning items back without their text: encrypted_content carries it.
    codex = {"type": "reasoning", "id": r.output[0].id, "summary": []}
    codex["encrypted_content"] = r.output[0].encrypted_content
    client.responses.create(
        model="m", input=[*ask("Weather?"), codex, {"role": "user", "content": "ok"}]
    )
    assert engine.submissions[-1].prompt.messages[1].reasoning == sent[1].reasoning


def test_chat_reasoning_sent_back_under_either_name_renders_as_reasoning_content():
    for key in ("reasoning_content", "reasoning"):
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", key: "because"},
        ]
        assert template_messages(conversation_from_dicts(messages))[1]["reasoning_content"] == (
            "because"
        )


def test_chat_reasoning_fields_are_honoured_or_refused(client, engine):
    def sent(**extra):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], **extra
        )
        return engine.submissions[-1]

    none = sent(reasoning_effort="none")
    assert none.prompt.chat_template_kwargs == {"enable_thinking": False}
    assert none.sampling.reasoning_budget == 0
    assert sent(reasoning_effort="low").sampling.reasoning_budget == 1024
    assert sent(reasoning_effort="high").sampling.reasoning_budget is None
    assert sent(extra_body={"thinking_token_budget": 7}).sampling.reasoning_budget == 7
    kept = sent(
        reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert kept.prompt.chat_template_kwargs == {"enable_thinking": True}  # the client's wins
    for extra, param in (
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"extra_body": {"thinking_token_budget": -1}}, "thinking_token_budget"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            sent(**extra)
        assert info.value.body["param"] == param
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": 3}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[*bad, {"role": "user", "content": "x"}])
    assert info.value.body["param"] == "messages[1].reasoning"


def test_responses_effort_is_a_budget(client, engine):
    r = client.responses.create(model="m", input="x", reasoning={"effort": "medium"})
    assert engine.submissions[-1].sampling.reasoning_budget == 4096
    assert r.reasoning.effort == "medium"
    client.responses.create(model="m", input="x", reasoning={"effort": "none"})
    assert engine.submissions[-1].prompt.chat_template_kwargs == {"enable_thinking": False}
