"""Anthropic Messages bodies -> engine records (pure: no server, no engine)."""

from __future__ import annotations

import json

import pytest

from mlx_prefix.conversation import Message, ToolCall
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import Breakpoint
from mlx_prefix.server.protocol.anthropic.blocks import is_billing_header
from mlx_prefix.server.protocol.anthropic.bodies import parse_count_tokens, parse_messages_request
from mlx_prefix.server.protocol.request import Limits

LIMITS = Limits(default_max_tokens=512, max_tokens=4096)
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.593; cc_entrypoint=sdk-cli; cch=4f2a;"
TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


SCHEMA_FORMAT = {"type": "json_schema", "schema": {"type": "object", "properties": {}}}


def body(**fields) -> dict:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def parse(**fields):
    return parse_messages_request(body(**fields), LIMITS)


def tool_turns(result: dict | None = None) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                result
                or {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18C"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]


def test_fields_map_onto_sampling_and_the_prompt():
    r = parse(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        stop_sequences=["END"],
        stream=True,
        metadata={"user_id": "session-123"},
        max_tokens=99999,
    )
    g = r.generation
    assert g.sampling.temperature == 0.5 and g.sampling.top_p == 0.9 and g.sampling.top_k == 40
    assert g.sampling.stop == ("END",) and g.stream is True
    assert g.sampling.max_tokens == LIMITS.max_tokens  # bounded by the context, not refused
    assert g.fit_reply is False and g.model == "claude-sonnet-4-5"
    assert g.prompt.messages[0] == Message("system", "Be brief.")
    assert parse().generation.sampling.temperature == 1.0  # Anthropic's default


def test_system_string_and_blocks_render_alike():
    a = parse(system="Be brief.").generation.prompt
    b = parse(system=[{"type": "text", "text": "Be brief."}]).generation.prompt
    assert a == b


def test_billing_header_is_left_out_unless_kept():
    system = [{"type": "text", "text": BILLING}, {"type": "text", "text": "You are helpful."}]
    dropped = parse(system=system).generation.prompt.messages[0].content
    assert dropped == "You are helpful."
    kept = parse_messages_request(body(system=system), LIMITS, keep_billing_header=True)
    assert kept.generation.prompt.messages[0].content == BILLING + "You are helpful."
    assert is_billing_header("x-other-header: a=1; b=two")
    assert not is_billing_header("x-anthropic-billing-header: then a whole paragraph\nof text")
    assert not is_billing_header("You are Claude Code.")


def test_tool_round_trip_becomes_tool_calls_and_a_tool_message():
    g = parse(messages=tool_turns(), tools=[TOOL]).generation
    user, assistant, tool, follow_up = g.prompt.messages
    assert assistant.content == "Let me check."
    assert assistant.reasoning == "Use the tool."
    assert assistant.tool_calls == (ToolCall("get_weather", {"city": "Paris"}, "toolu_1"),)
    assert tool == Message("tool", "18C", tool_call_id="toolu_1", name="get_weather")
    assert follow_up == Message("user", "And tomorrow?")
    assert g.prompt.tools[0]["function"]["parameters"] == TOOL["input_schema"]
    assert g.parse_tools is True


def test_tool_result_error_is_marked():
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": "timeout",
        "is_error": True,
    }
    messages = parse(messages=tool_turns(result), tools=[TOOL]).generation.prompt.messages
    assert messages[2].content == "Error: timeout"


def test_breakpoints_from_cache_control():
    system = [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "Agent.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " More rules.", "cache_control": {"type": "ephemeral"}},
    ]
    tools = [TOOL, {**TOOL, "name": "t2", "cache_control": {"type": "ephemeral"}}]
    messages = tool_turns()
    messages[2]["content"][1]["cache_control"] = {"type": "ephemeral"}
    prompt = parse(system=system, tools=tools, messages=messages).generation.prompt
    assert set(prompt.breakpoints) == {
        Breakpoint(tool=1),
        Breakpoint(message=0, chars=len("Agent.")),
        Breakpoint(message=0),
        Breakpoint(message=4),
    }
    auto = parse(cache_control={"type": "ephemeral"}).generation.prompt
    assert auto.breakpoints == (Breakpoint(message=0),)


def test_thinking_maps_to_the_template_switch():
    assert parse().generation.prompt.chat_template_kwargs == {}
    on = parse(thinking={"type": "enabled", "budget_tokens": 2048}, max_tokens=4000)
    assert on.generation.prompt.chat_template_kwargs == {"enable_thinking": True}
    off = parse(thinking={"type": "disabled"})
    assert off.generation.prompt.chat_template_kwargs == {"enable_thinking": False}
    adaptive = parse(thinking={"type": "adaptive", "display": "omitted"})
    assert adaptive.generation.prompt.chat_template_kwargs == {}
    assert adaptive.show_thinking is False
    low = parse(thinking={"type": "adaptive"}, output_config={"effort": "low"})
    assert low.generation.prompt.chat_template_kwargs == {"enable_thinking": False}
    medium = parse(thinking={"type": "adaptive"}, output_config={"effort": "medium"})
    assert medium.generation.prompt.chat_template_kwargs == {}


def test_thinking_budget_bounds_the_reasoning_below_anthropics_floor():
    on = parse(thinking={"type": "enabled", "budget_tokens": 400}, max_tokens=4000)
    assert on.generation.sampling.reasoning_budget == 400  # Anthropic's floor is 1024
    assert parse(thinking={"type": "adaptive"}).generation.sampling.reasoning_budget is None
    # Off also closes at once a block the template opens without a switch.
    assert parse(thinking={"type": "disabled"}).generation.sampling.reasoning_budget == 0
    low = parse(output_config={"effort": "low"}).generation.sampling
    assert low.reasoning_budget == 0


def test_tool_choice_modes():
    tools = [TOOL]
    assert parse(tools=tools).generation.tool_choice.mode == "auto"
    forced = parse(tools=tools, tool_choice={"type": "any"}).generation
    assert forced.tool_choice.mode == "required"
    named = parse(tools=tools, tool_choice={"type": "tool", "name": "get_weather"}).generation
    assert named.tool_choice.mode == "named" and named.tool_choice.name == "get_weather"
    single = parse(tools=tools, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert single.generation.tool_choice.parallel is False
    none = parse(tools=tools, tool_choice={"type": "none"}).generation
    assert none.prompt.tools is None and none.parse_tools is False


def test_deferred_tools_stay_out_until_referenced():
    deferred = {**TOOL, "name": "late_tool", "defer_loading": True}
    turns = tool_turns(
        {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [{"type": "tool_reference", "tool_name": "late_tool"}],
        }
    )
    g = parse(messages=turns, tools=[TOOL, deferred]).generation
    assert [t["function"]["name"] for t in g.prompt.tools] == ["get_weather"]
    assert '"late_tool"' in g.prompt.messages[2].content


def test_count_tokens_parses_the_same_prompt():
    model, prompt = parse_count_tokens(body(system="Be brief.", tools=[TOOL]))
    assert model == "claude-sonnet-4-5"
    assert prompt == parse(system="Be brief.", tools=[TOOL]).generation.prompt


BAD = {
    "max_tokens missing": ({"max_tokens": None}, "max_tokens"),
    "model missing": ({"model": None}, "model"),
    "messages empty": ({"messages": []}, "messages"),
    "role unknown": ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    "unknown block": (
        {"messages": [{"role": "user", "content": [{"type": "hologram", "data": "x"}]}]},
        "messages[0].content[0]",
    ),
    "image block": (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].source.type",
    ),
    "orphan tool_result": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}],
                }
            ]
        },
        "messages[0].content[0].tool_use_id",
    ),
    "final assistant message": (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        "messages[1]",
    ),
    "temperature above 1": ({"temperature": 1.5}, "temperature"),
    "top_k negative": ({"top_k": -1}, "top_k"),
    "server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0].type",
    ),
    "tool without schema": ({"tools": [{"name": "t"}]}, "tools[0].input_schema"),
    "strict tool": ({"tools": [{**TOOL, "strict": True}]}, "tools[0].strict"),
    "named tool unknown": (
        {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice.name",
    ),
    "forced without tools": ({"tool_choice": {"type": "any"}}, "tool_choice"),
    "forced with thinking": (
        {
            "tools": [TOOL],
            "tool_choice": {"type": "any"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "max_tokens": 2000,
        },
        "tool_choice",
    ),
    "budget not below max_tokens": (
        {"thinking": {"type": "enabled", "budget_tokens": 2048}},
        "thinking.budget_tokens",
    ),
    "thinking type": ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    "negative budget": (
        {"thinking": {"type": "enabled", "budget_tokens": -1}},
        "thinking.budget_tokens",
    ),
    "effort unknown": ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    "context edit": (
        {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        "context_management.edits[0]",
    ),
    "stop_sequences type": ({"stop_sequences": "END"}, "stop_sequences"),
    "stop_sequences too long": ({"stop_sequences": ["y" * 1025]}, "stop_sequences"),
    "unknown field": ({"temprature": 0.5}, "temprature"),
    "unknown output_config key": (
        {"output_config": {"verbosity": "low"}},
        "output_config.verbosity",
    ),
    "output_format type": ({"output_format": {"type": "json_object"}}, "output_format.type"),
    "output_format without schema": (
        {"output_format": {"type": "json_schema"}},
        "output_format.schema",
    ),
    "output_format twice": (
        {"output_format": SCHEMA_FORMAT, "output_config": {"format": SCHEMA_FORMAT}},
        "output_format",
    ),
    "output_format with stop_sequences": (
        {"output_format": SCHEMA_FORMAT, "stop_sequences": ["}"]},
        "stop_sequences",
    ),
    "output_format with tools": (
        {"output_format": SCHEMA_FORMAT, "tools": [TOOL]},
        "output_format",
    ),
    "prefix_cache key typo": ({"prefix_cache": {"enable": False}}, "prefix_cache.enable"),
    "mcp servers": ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
}


def test_output_format_becomes_the_response_format():
    beta = parse(output_format=SCHEMA_FORMAT).generation.sampling.response_format
    ga = parse(output_config={"format": SCHEMA_FORMAT, "effort": "high"}).generation
    assert beta.kind == "json_schema" and json.loads(beta.schema) == SCHEMA_FORMAT["schema"]
    assert ga.sampling.response_format == beta
    assert parse().generation.sampling.response_format is None


@pytest.mark.parametrize("name", list(BAD))
def test_bad_bodies_name_the_field(name):
    fields, param = BAD[name]
    b = body(**fields)
    for key in [k for k, v in fields.items() if v is None]:
        del b[key]
    with pytest.raises(InvalidRequest) as err:
        parse_messages_request(b, LIMITS)
    assert err.value.param == param, err.value.message
