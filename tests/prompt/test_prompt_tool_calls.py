"""Splitting, parsing and naming a reply's tool calls: what the server answers and what the
engine's prefetch renders must agree, whatever deltas the reply arrived in."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import kimi_k2

from mlx_prefix.conversation import Message
from mlx_prefix.prompt.reply.reader import client_reply
from mlx_prefix.prompt.reply.tool_calls import CallParser, ReplySplitter, ToolSyntax
from mlx_prefix.records import ToolCallIds
from mlx_prefix.server.protocol.messages import conversation_from_dicts

JSON_TOOLS = ToolSyntax.of(
    type(
        "Tok",
        (),
        {
            "has_tool_calling": True,
            "tool_call_start": "<tool_call>",
            "tool_call_end": "</tool_call>",
            "tool_parser": staticmethod(lambda text, tools: json.loads(text.strip())),
        },
    )()
)
TOOLS = ({"type": "function", "function": {"name": "f"}},)
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def split_in(reply: str, step: int) -> tuple[str, int]:
    assert JSON_TOOLS is not None
    splitter = ReplySplitter(JSON_TOOLS)
    parts = [splitter.feed(reply[i : i + step]) for i in range(0, len(reply), step)]
    parts.append(splitter.finish())
    return "".join(p.text for p in parts), sum(len(p.calls) for p in parts)


@pytest.mark.parametrize(
    ("reply", "text"),
    [
        (f"\n{CALL}\n{CALL}\n", ""),  # only whitespace around calls: dropped
        (f"Sure.\n{CALL}\n", "Sure.\n"),  # real text keeps its whitespace
        (f"Sure.\n{CALL}\n{CALL}", "Sure.\n"),  # a whitespace run between calls does not
        (f"\n\n{CALL} done\n", " done\n"),  # text after the calls still counts
        ("\n  \n", "\n  \n"),  # no calls: a whitespace reply is the reply
    ],
)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_whitespace_around_calls_is_dropped_whatever_the_deltas(reply, text, step):
    assert split_in(reply, step)[0] == text


def test_ids_come_from_the_request_unless_the_model_names_its_calls():
    ids = ToolCallIds("resp_1")
    assert ids.id(0) != ids.id(1) and ids.id(0) == ToolCallIds("resp_1").id(0)
    assert ToolCallIds("msg_1", prefix="toolu_").id(0).startswith("toolu_")
    assert JSON_TOOLS is not None
    parser = CallParser(JSON_TOOLS, TOOLS, ids)
    calls, failed = parser.parse(['{"name": "f", "arguments": {"x": 1}}', "{bad"])
    more, _ = parser.parse(['{"name": "g", "arguments": "{}"}'])
    assert [c.id for c in calls + more] == [ids.id(0), ids.id(1)]  # counted across feeds
    assert calls[0].arguments == '{"x": 1}' and more[0].arguments == "{}"
    assert failed == "<tool_call>{bad</tool_call>"
    # Kimi's parser returns the id the model wrote (its template prints it back).
    kimi = ToolSyntax(kimi_k2.tool_call_start, kimi_k2.tool_call_end, kimi_k2.parse_tool_call)
    body = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    (call,), _ = CallParser(kimi, TOOLS, ids).parse([body])
    assert call.id == "functions.f:0"


def test_client_reply_is_the_message_every_api_family_parses_back():
    ids = ToolCallIds("chatcmpl-9")
    turn = client_reply(JSON_TOOLS, f"Checking.\n{CALL}", TOOLS, ids)
    assert turn.call_ids == (ids.id(0),)
    function = {"name": "f", "arguments": '{"x": 1}'}  # as a chat client sends it back
    sent_back = {
        "role": "assistant",
        "content": "Checking.\n",
        "tool_calls": [{"id": ids.id(0), "type": "function", "function": function}],
    }
    assert (turn.message,) == conversation_from_dicts([sent_back])
    # Without tools offered (or without a tool syntax) nothing is parsed: it is text.
    assert client_reply(JSON_TOOLS, CALL, None, ids).message == Message("assistant", CALL)
    assert client_reply(None, CALL, TOOLS, ids).call_ids == ()
