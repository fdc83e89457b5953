"""The typed conversation (mlx_prefix/conversation.py): each API family's parser builds it
once, malformed messages are refused there with a 400 naming the field, and the same
conversation sent through chat completions, Anthropic Messages or Responses is the same
record and renders the same tokens."""

from __future__ import annotations

import httpx
import pytest
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.conversation import Message, ToolCall, template_messages
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.records import PromptInput, ToolCallIds
from mlx_prefix.server.protocol.anthropic.bodies import parse_messages_request
from mlx_prefix.server.protocol.chat import parse_chat
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.server.protocol.request import Limits
from mlx_prefix.server.protocol.responses.bodies import parse_responses

LIMITS = Limits(default_max_tokens=64, max_tokens=4096)
PARIS = '{"city": "Paris"}'
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}

# One tool loop, in each API family's own shape: a system prompt, a question, a reply
# with reasoning, text and a call, the call's result, a new question.
CHAT = {
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                     {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18C"},
        {"role": "user", "content": "And tomorrow?"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
}  # fmt: skip
MESSAGES = {
    "model": "m",
    "max_tokens": 64,
    "system": [{"type": "text", "text": "Be brief."}],
    "tools": [{"name": "get_weather", "input_schema": WEATHER}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "text", "text": "And tomorrow?"}]},
    ],
}  # fmt: skip
RESPONSES = {
    "model": "m",
    "instructions": "Be brief.",
    "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "toolu_1", "name": "get_weather",
         "arguments": PARIS},
        {"type": "function_call_output", "call_id": "toolu_1", "output": "18C"},
        {"role": "user", "content": "And tomorrow?"},
    ],
}  # fmt: skip

EXPECTED = (
    Message("system", "Be brief."),
    Message("user", "Weather in Paris?"),
    Message(
        "assistant",
        "Checking.",
        tool_calls=(ToolCall("get_weather", {"city": "Paris"}, "toolu_1"),),
        reasoning="Use the tool.",
    ),
    Message("tool", "18C", tool_call_id="toolu_1", name="get_weather"),
    Message("user", "And tomorrow?"),
)


def prompts() -> dict[str, PromptInput]:
    return {
        "chat": parse_chat(CHAT, LIMITS).prompt,
        "messages": parse_messages_request(MESSAGES, LIMITS).generation.prompt,
        "responses": parse_responses(RESPONSES, LIMITS).prompt((), ToolCallIds("resp_1")),
    }


def test_every_api_family_builds_the_same_conversation():
    built = prompts()
    assert built["chat"].messages == built["messages"].messages == EXPECTED
    # A Responses tool result names no function: the one difference its shape allows.
    without_name = (*EXPECTED[:3], Message("tool", "18C", tool_call_id="toolu_1"), EXPECTED[4])
    assert built["responses"].messages == without_name


def test_the_same_conversation_renders_the_same_tokens_through_every_family():
    planner = PromptPlanner(loaded_test_model("dense", think_template=True).tokenizer, TEST_CACHE)
    built = prompts()
    rendered = {name: planner.plan(prompt).tokens for name, prompt in built.items()}
    assert rendered["chat"] == rendered["messages"]
    text = planner.renderer.tokenizer.decode(list(rendered["chat"]))
    assert "Weather in Paris?" in text and '"city": "Paris"' in text and "18C" in text
    # The same tools and conversation as chat, built by hand: no parser, same tokens.
    by_hand = PromptInput(messages=EXPECTED, tools=built["chat"].tools)
    assert planner.plan(by_hand).tokens == rendered["chat"]


def test_equal_conversations_are_equal_records_whatever_form_they_came_in():
    def call(arguments) -> dict:
        function = {"name": "f", "arguments": arguments}
        return {"role": "assistant", "tool_calls": [{"id": "c", "function": function}]}

    forms = [
        call('{"b": 1, "a": [{"y": 2, "x": 1}]}'),
        call({"a": [{"x": 1, "y": 2}], "b": 1}),
        call('{"a":[{"x":1,"y":2}],"b":1}'),
    ]
    conversations = [conversation_from_dicts([form]) for form in forms]
    assert all(c == conversations[0] for c in conversations)
    assert len({hash(c) for c in conversations}) == 1  # hashable, and equal hashes
    (message,) = conversations[0]
    assert list(message.tool_calls[0].arguments) == ["a", "b"]  # sorted once, when built
    (rendered,) = template_messages(conversations[0])
    function = {"name": "f", "arguments": message.tool_calls[0].arguments}
    assert rendered["tool_calls"] == [{"type": "function", "function": function, "id": "c"}]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "messages[0].content[0].image_url",
        ),
        ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function",
        ),
        ([{"role": "user", "content": "x", "reasoning": "r"}], "messages[0].reasoning"),
        ([], "messages"),
    ],
)
def test_a_malformed_message_is_refused_naming_its_field(messages, param):
    with pytest.raises(InvalidRequest) as e:
        conversation_from_dicts(messages)
    assert e.value.status == 400 and e.value.param == param


def test_a_prompt_takes_the_typed_conversation_only():
    with pytest.raises(TypeError, match="conversation_from_dicts"):
        PromptInput(messages=({"role": "user", "content": "hi"},))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="role"):
        Message("developer", "x")  # type: ignore[arg-type]


def test_the_protocol_layer_refuses_once_in_each_apis_error_shape():
    """A call without a function name: a 400 from the parser, in the API's own shape,
    and nothing reaches the engine (which would not check it again)."""
    no_name = {"id": "c", "type": "function", "function": {"arguments": "{}"}}
    chat = {"model": "fake-model", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [no_name]},
        {"role": "user", "content": "again"}]}  # fmt: skip
    anthropic = {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "image"}]}]}
    with serving() as (url, engine), httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function"
        r = http.post("/v1/messages", json=anthropic)
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "messages[0].content[0]" in r.json()["error"]["message"]
        r = http.post("/v1/responses", json={**RESPONSES, "input": [{"role": "robot"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].role"
        assert engine.submissions == []
