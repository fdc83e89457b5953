"""The official `openai` client's `responses.create` against a live server backed by the
fake engine: shapes, the stream's event sequence, function tools, the response store,
and refused fields."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.live import live_server, tool_calling_engine
from support.server_fakes import DEFAULT_REPLY, serving

from mlx_prefix.records import ToolCallIds
from mlx_prefix.server.protocol.messages import conversation_from_dicts

TOOL_REPLY = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}


live = live_server(tool_calling_engine, responses_store=4)


def test_plain_response(client, engine):
    r = client.responses.create(model="fake-model", input="plain one", instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == DEFAULT_REPLY and r.model == "fake-model"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == len(DEFAULT_REPLY.split())
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.store is True
    submitted = engine.submissions[-1]
    assert submitted.prompt.messages == conversation_from_dicts(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "plain one"}]
    )
    assert submitted.request_id == r.id
    assert submitted.sampling.temperature == 0.0 and submitted.sampling.stop == ()


def test_input_items_and_sampling_are_honoured(client, engine):
    r = client.responses.create(
        model="fake-model",
        input=[
            {"role": "developer", "content": "Answer in French."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "split "},
                    {"type": "input_text", "text": "parts"},
                ],
            },
        ],  # fmt: skip
        temperature=0.7,
        top_p=0.9,
        max_output_tokens=40,
        metadata={"ticket": "42"},
    )
    submitted = engine.submissions[-1]
    assert submitted.prompt.messages == conversation_from_dicts(
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "split parts"},
        ]
    )
    assert (submitted.sampling.temperature, submitted.sampling.top_p) == (0.7, 0.9)
    assert submitted.sampling.max_tokens == 40
    assert r.metadata == {"ticket": "42"} and r.temperature == 0.7 and r.max_output_tokens == 40


def test_chained_with_previous_response_id(client, engine):
    first = client.responses.create(model="fake-model", input="Name a colour.")
    second = client.responses.create(
        model="fake-model", input="Another one?", previous_response_id=first.id
    )
    assert engine.submissions[-1].prompt.messages == conversation_from_dicts(
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": DEFAULT_REPLY},
            {"role": "user", "content": "Another one?"},
        ]
    )
    # The first turn's prompt is its prefix (the fake engine caches prompts only).
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens
    assert second.previous_response_id == first.id
    third = client.responses.create(
        model="fake-model", input="And a third?", previous_response_id=second.id
    )
    assert len(engine.submissions[-1].prompt.messages) == 5
    assert third.usage.input_tokens_details.cached_tokens == second.usage.input_tokens


def test_streaming_event_sequence(client):
    with client.responses.create(model="fake-model", input="stream please", stream=True) as s:
        events = list(s)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas == len(DEFAULT_REPLY.split())
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == DEFAULT_REPLY == events[-4].text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[2].item.id}
    done = events[-1].response
    assert done.status == "completed" and done.output_text == DEFAULT_REPLY
    assert done.usage.input_tokens_details.cached_tokens >= 0 and done.usage.output_tokens > 0
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_the_sdk_stream_helper_accumulates_a_tool_call(client):
    with client.responses.stream(
        model="fake-model", input=f"weather? [[reply:{TOOL_REPLY}]]", tools=[WEATHER]
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    message, call = final.output
    assert message.content[0].text == "Let me check. "
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id == ToolCallIds(final.id).id(0)


def test_function_tools_round_trip(client, engine):
    question = [{"role": "user", "content": f"weather? [[reply:{TOOL_REPLY}]]"}]
    r = client.responses.create(model="fake-model", input=question, tools=[WEATHER])
    assert engine.submissions[-1].prompt.tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": WEATHER["parameters"],
            },
        },
    )
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    message, call = r.output
    assert message.content[0].text == "Let me check. "
    # Its id is the request's, as the engine's next-turn prefetch names it.
    assert call.call_id == ToolCallIds(r.id).id(0)
    assert engine.submissions[-1].prompt.reply_tool_call_ids == ToolCallIds(r.id)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}
    client.responses.create(
        model="fake-model",
        input=[*question, *(item.model_dump(exclude_none=True) for item in r.output), result],
        tools=[WEATHER],
    )
    # The same messages a chat completions client sends back for the same reply.
    assert engine.submissions[-1].prompt.messages[1:] == conversation_from_dicts(
        (
            {
                "role": "assistant",
                "content": "Let me check. ",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "18C"},
        )
    )
    # Chained by id instead, the server rebuilds the same conversation.
    client.responses.create(model="fake-model", input=[result], previous_response_id=r.id)
    assert engine.submissions[-1].prompt.messages[1:] == engine.submissions[-2].prompt.messages[1:]


def test_parallel_tool_calls_false_stops_after_the_first_call(client, engine):
    r = client.responses.create(
        model="fake-model",
        input=f"two? [[reply:{TWO_CALLS}]]",
        tools=[WEATHER],
        parallel_tool_calls=False,
    )
    assert engine.submissions[-1].sampling.stop == ("</tool_call>",)
    (call,) = r.output
    assert json.loads(call.arguments) == {"city": "Paris"} and r.parallel_tool_calls is False
    r = client.responses.create(model="fake-model", input=f"[[reply:{TWO_CALLS}]]", tools=[WEATHER])
    assert [json.loads(c.arguments)["city"] for c in r.output] == ["Paris", "Oslo"]
    # tool_choice "none": no tools offered, the markup stays text.
    r = client.responses.create(
        model="fake-model", input=f"[[reply:{TOOL_REPLY}]]", tools=[WEATHER], tool_choice="none"
    )
    assert r.output_text == TOOL_REPLY and engine.submissions[-1].prompt.tools is None


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model="fake-model", input="cut short", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    with client.responses.create(
        model="fake-model", input="cut short", max_output_tokens=3, stream=True
    ) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_get_and_delete(client):
    r = client.responses.create(model="fake-model", input="keep me")
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == "completed"
    deleted = client.responses.delete(r.id)
    assert deleted is None  # the SDK returns nothing for a 200
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r.id)
    assert info.value.body["type"] == "invalid_request_error" and r.id in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    not_kept = client.responses.create(model="fake-model", input="forget me", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_kept.id)


def test_unknown_previous_response_is_a_404_and_the_server_keeps_serving(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="fake-model", input="hi", previous_response_id="resp_nope")
    assert info.value.status_code == 404
    assert info.value.body["code"] == "previous_response_not_found"
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["type"] == "invalid_request_error"
    assert client.responses.create(model="fake-model", input="still here?").status == "completed"


def test_another_namespace_cannot_read_continue_or_delete_a_response():
    # Two browser extensions: each one's stored responses are its own.
    mail = {"Origin": "chrome-extension://mailhelperextensionid"}
    page = {"Origin": "moz-extension://4b1d2c3e-unknown-page-script"}
    with serving() as (url, _), httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/responses", json={"model": "fake-model", "input": "a secret"}, headers=mail)
        rid = r.json()["id"]
        for headers in (page, {}):  # another extension, and a client without an Origin
            assert c.get(f"/v1/responses/{rid}", headers=headers).status_code == 404
            assert c.delete(f"/v1/responses/{rid}", headers=headers).status_code == 404
            body = {"model": "fake-model", "input": "go on", "previous_response_id": rid}
            chained = c.post("/v1/responses", json=body, headers=headers)
            assert chained.status_code == 404
            assert chained.json()["error"]["code"] == "previous_response_not_found"
        assert c.get(f"/v1/responses/{rid}", headers=mail).json()["id"] == rid  # still its own
        body = {"model": "fake-model", "input": "go on", "previous_response_id": rid}
        assert c.post("/v1/responses", json=body, headers=mail).status_code == 200
        assert c.delete(f"/v1/responses/{rid}", headers=mail).status_code == 200


def test_a_flood_from_one_namespace_does_not_evict_anothers():
    mail = {"Origin": "chrome-extension://mailhelperextensionid"}
    flood = {"Origin": "chrome-extension://floodingextensionid"}
    with serving(responses_store=4) as (url, _), httpx.Client(base_url=url, timeout=10) as c:

        def create(headers: dict, text: str) -> str:
            body = {"model": "fake-model", "input": text}
            return c.post("/v1/responses", json=body, headers=headers).json()["id"]

        kept = [create(mail, f"keep {i}") for i in range(2)]
        for i in range(10):  # capacity 4
            create(flood, f"flood {i}")
        for rid in kept:
            assert c.get(f"/v1/responses/{rid}", headers=mail).status_code == 200


def test_the_store_keeps_the_most_recent_responses(client):
    ids = [client.responses.create(model="fake-model", input=f"n{i}").id for i in range(5)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # capacity 4: the oldest went first
    assert client.responses.retrieve(ids[1]).id == ids[1]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER]}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
            "input[0].encrypted_content",
        ),
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused(client, extra, param):
    kwargs = {"model": "fake-model", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_harmless_fields_and_empty_defaults_are_accepted(client):
    r = client.responses.create(
        model="fake-model",
        input="hi",
        user="u-1",
        prompt_cache_key="thread-9",
        parallel_tool_calls=True,
        store=True,
        include=["reasoning.encrypted_content"],  # Codex's: no reasoning items, nothing to add
        reasoning={"effort": None, "summary": "auto"},
        text={"format": {"type": "text"}},
        truncation="disabled",
        service_tier="auto",
        extra_body={"background": False, "client_metadata": {"k": "v"}},
    )
    assert r.status == "completed" and r.user == "u-1" and r.prompt_cache_key == "thread-9"


def test_logprobs_on_request(client):
    r = client.responses.create(
        model="fake-model", input="lp", include=["message.output_text.logprobs"]
    )
    logprobs = r.output[0].content[0].logprobs
    assert [lp.logprob for lp in logprobs] == [-0.25] * len(DEFAULT_REPLY.split())
    assert "".join(lp.token for lp in logprobs) == DEFAULT_REPLY


def test_an_engine_failure_mid_stream_is_a_failed_event(live):
    url, _ = live
    body = {"model": "fake-model", "input": "[[fail_after:2]]", "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "fake engine failed mid-stream"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
