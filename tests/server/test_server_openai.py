"""The official `openai` client against a live server backed by the fake engine."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import openai
import pytest
from support.live import live_server, openai_client, tool_calling_engine
from support.server_fakes import DEFAULT_REPLY, serving

from mlx_prefix.config import DiskScope
from mlx_prefix.conversation import Message, ToolCall
from mlx_prefix.records import CachePreference, ToolCallIds

TOOL_REPLY = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


live = live_server(lambda: tool_calling_engine(path=Path("/models/org/SmolLM-fake")))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model="fake-model", messages=user("chat non-stream"))
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == DEFAULT_REPLY
    assert choice.finish_reason == "stop"
    assert r.model == "fake-model" and r.object == "chat.completion"
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens == len(DEFAULT_REPLY.split())
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming(client):
    with client.chat.completions.create(
        model="fake-model", messages=user("chat stream"), stream=True
    ) as stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == DEFAULT_REPLY
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_completions(client):
    r = client.completions.create(model="fake-model", prompt="Once upon a time")
    assert r.choices[0].text == DEFAULT_REPLY
    assert r.usage.prompt_tokens == 4
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    with client.completions.create(
        model="fake-model", prompt=["Twice upon a time"], stream=True
    ) as stream:
        chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == DEFAULT_REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_cached_tokens_reported_on_repeat(client):
    messages = [
        {"role": "system", "content": "A long shared instruction prompt. " * 5},
        {"role": "user", "content": "first question"},
    ]
    first = client.chat.completions.create(model="fake-model", messages=messages)
    second = client.chat.completions.create(model="fake-model", messages=messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the fake always leaves one prompt token to compute, like the real engine
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    messages[1]["content"] = "second question"
    third = client.chat.completions.create(model="fake-model", messages=messages)
    assert 0 < third.usage.prompt_tokens_details.cached_tokens < third.usage.prompt_tokens - 1


def test_include_usage_chunk(client):
    messages = user("usage chunk please")
    client.chat.completions.create(model="fake-model", messages=messages)
    with client.chat.completions.create(
        model="fake-model",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    ) as stream:
        chunks = list(stream)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == len(DEFAULT_REPLY.split())
    assert last.usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_stop_and_sampling_passthrough(client, engine):
    r = client.chat.completions.create(
        model="fake-model",
        messages=user("stop early"),
        stop=[" fake", "never"],
        seed=7,
        temperature=0.7,
        top_p=0.9,
        max_completion_tokens=50,
    )
    assert r.choices[0].message.content == "Hello from the"
    assert r.choices[0].finish_reason == "stop"
    sampling = engine.submissions[-1].sampling
    assert sampling.stop == (" fake", "never")
    assert (sampling.seed, sampling.temperature, sampling.top_p) == (7, 0.7, 0.9)
    assert sampling.max_tokens == 50
    r = client.completions.create(model="fake-model", prompt="stop as string", stop="engine")
    assert r.choices[0].text == "Hello from the fake "
    assert engine.submissions[-1].sampling.stop == ("engine",)


def test_max_tokens_gives_length(client, engine):
    r = client.chat.completions.create(model="fake-model", messages=user("short"), max_tokens=3)
    assert r.choices[0].message.content == "Hello from the"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert engine.submissions[-1].sampling.max_tokens == 3


def test_default_max_tokens(client, engine):
    client.completions.create(model="fake-model", prompt="defaults")
    assert engine.submissions[-1].sampling.max_tokens == 512


@pytest.mark.parametrize(
    "alias", ["fake-model", "/models/org/SmolLM-fake", "SmolLM-fake", "default"]
)
def test_model_aliases(client, alias):
    r = client.chat.completions.create(model=alias, messages=user(f"alias {alias}"))
    assert r.model == "fake-model"
    assert r.choices[0].message.content == DEFAULT_REPLY


def test_unknown_model_is_answered_by_the_default_model(client):
    r = client.chat.completions.create(model="gpt-4o-mini", messages=user("unknown name"))
    assert r.model == "fake-model"  # says which model answered
    assert r.choices[0].message.content == DEFAULT_REPLY


def test_strict_model_names_lists_served_models():
    with serving(strict_model_names=True, aliases=("house",)) as (url, _):
        with openai_client(url) as client:
            with pytest.raises(openai.NotFoundError) as err:
                client.chat.completions.create(model="gpt-4o", messages=user("hi"))
            assert client.chat.completions.create(model="house", messages=user("a")).model == (
                "fake-model"
            )
    error = err.value.body
    assert err.value.status_code == 404
    assert error["code"] == "model_not_found"
    assert "gpt-4o" in error["message"] and "fake-model" in error["message"]
    assert "house" in error["message"]


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"


def test_content_parts_render_like_strings(client, engine):
    parts = [{"type": "text", "text": "split "}, {"type": "text", "text": "into parts"}]
    client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": parts}]
    )
    from_parts = engine.submissions[-1].prompt
    second = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "split into parts"}]
    )
    assert engine.submissions[-1].prompt == from_parts
    assert from_parts.messages[0].content == "split into parts"
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


def test_prefix_cache_extension_and_template_kwargs(client, engine):
    messages = user("no caching for this one")
    for _ in range(2):
        r = client.chat.completions.create(
            model="fake-model",
            messages=messages,
            extra_body={
                "prefix_cache": {"enabled": False, "scope": "off"},
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    submission = engine.submissions[-1]
    assert submission.cache == CachePreference(enabled=False, scope=DiskScope.parse("off"))
    assert submission.prompt.chat_template_kwargs == {"enable_thinking": False}


def test_logprobs(client, engine):
    r = client.chat.completions.create(model="fake-model", messages=user("lp"), logprobs=True)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == DEFAULT_REPLY
    assert {t.logprob for t in content} == {-0.25}
    assert engine.submissions[-1].sampling.logprobs is True
    r = client.chat.completions.create(model="fake-model", messages=user("no lp"))
    assert r.choices[0].logprobs is None


def test_tool_calls_non_streaming(client, engine):
    r = client.chat.completions.create(
        model="fake-model",
        messages=user(f"weather? [[reply:{TOOL_REPLY}]]"),
        tools=[WEATHER_TOOL],
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert engine.submissions[-1].prompt.tools == (WEATHER_TOOL,)
    # Named after the request, as the engine's next-turn prefetch names it.
    assert engine.submissions[-1].prompt.reply_tool_call_ids == ToolCallIds(r.id)
    assert call.id == ToolCallIds(r.id).id(0)


def test_tool_calls_streaming(client):
    with client.chat.completions.create(
        model="fake-model",
        messages=user(f"weather? [[reply:{TOOL_REPLY}]]"),
        tools=[WEATHER_TOOL],
        stream=True,
    ) as stream:
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert text == "Let me check. "  # no markup leaks into content
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_legacy_functions_are_offered_as_tools_and_answered_as_function_call(client, engine):
    """The deprecated `functions` / `function_call` fields: the model sees the tools, and
    the call comes back in the old shape."""
    function = WEATHER_TOOL["function"]
    r = client.chat.completions.create(
        model="fake-model",
        messages=user(f"weather? [[reply:{TOOL_REPLY}]]"),
        functions=[function],
    )
    assert engine.submissions[-1].prompt.tools == (WEATHER_TOOL,)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments) == {"city": "Paris"}
    with client.chat.completions.create(
        model="fake-model",
        messages=user(f"weather? [[reply:{TOOL_REPLY}]]"),
        functions=[function],
        stream=True,
    ) as stream:
        chunks = list(stream)
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices[0].delta.function_call]
    assert [c.name for c in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "function_call"
    named = client.chat.completions.create(
        model="fake-model",
        messages=user('weather? [[reply:{"city": "Oslo"}}</tool_call>]]'),
        functions=[function],
        function_call={"name": "get_weather"},
    )
    assert engine.submissions[-1].prompt.assistant_prefix.startswith("<tool_call>")
    assert json.loads(named.choices[0].message.function_call.arguments) == {"city": "Oslo"}
    none = client.chat.completions.create(
        model="fake-model", messages=user("hi"), functions=[function], function_call="none"
    )
    assert none.choices[0].finish_reason == "stop" and engine.submissions[-1].prompt.tools is None


def test_legacy_function_history_becomes_tool_turns(client, engine):
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    client.chat.completions.create(
        model="fake-model", messages=messages, functions=[WEATHER_TOOL["function"]]
    )
    sent = engine.submissions[-1].prompt.messages
    assert sent[1].tool_calls == (ToolCall("get_weather", {"city": "Paris"}, "call_1"),)
    assert sent[2] == Message("tool", "sunny", name="get_weather")


def test_tool_choice_none_keeps_markup_as_text(client, engine):
    r = client.chat.completions.create(
        model="fake-model",
        messages=user(f"weather? [[reply:{TOOL_REPLY}]]"),
        tools=[WEATHER_TOOL],
        tool_choice="none",
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == TOOL_REPLY
    assert engine.submissions[-1].prompt.tools is None


def test_assistant_tool_call_history_is_accepted(client, engine):
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model="fake-model", messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == DEFAULT_REPLY
    sent = engine.submissions[-1].prompt.messages
    assert sent[1].content == ""
    assert sent[1].tool_calls[0].arguments == {"city": "Paris"}


def test_one_log_line_per_request(client, caplog):
    caplog.set_level(logging.INFO, logger="mlx_prefix.server")
    messages = user("log me")
    client.chat.completions.create(model="fake-model", messages=messages)
    r = client.chat.completions.create(model="fake-model", messages=messages)
    lines = [rec.getMessage() for rec in caplog.records if r.id in rec.getMessage()]
    assert len(lines) == 1, caplog.text
    fields = dict(re.findall(r"(\w+)=(\S+)", lines[0]))
    assert lines[0].startswith(f"{r.id} /v1/chat/completions ")
    assert int(fields["prompt"]) == r.usage.prompt_tokens
    assert int(fields["cached"]) == r.usage.prompt_tokens_details.cached_tokens > 0
    assert fields["status"] == "200"
    assert fields["ttft"].endswith("ms") and fields["decode"].endswith("tok/s")


def test_tool_choice_required_and_named_are_honoured(client, engine):
    args = '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    r = client.chat.completions.create(
        model="fake-model",
        messages=user(f"weather? [[reply:{args}]]"),
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    assert engine.submissions[-1].prompt.assistant_prefix == "<tool_call>"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"
    }
    assert r.choices[0].finish_reason == "tool_calls"
    named = client.chat.completions.create(
        model="fake-model",
        messages=user('weather? [[reply:{"city": "Rome"}}</tool_call>]]'),
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    prefix = engine.submissions[-1].prompt.assistant_prefix
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome"}


def test_parallel_tool_calls_false_ends_after_the_first_call(client):
    two = TOOL_REPLY + TOOL_REPLY.replace("Paris", "Lyon")
    r = client.chat.completions.create(
        model="fake-model",
        messages=user(f"both? [[reply:{two}]]"),
        tools=[WEATHER_TOOL],
        parallel_tool_calls=False,
    )
    calls = r.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required", "tools": None},
        {"tool_choice": {"type": "function"}},
    ],
)
def test_bad_tool_choice_is_a_400(client, extra):
    body = {"tools": [WEATHER_TOOL], **extra}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake-model", messages=user("x"), **body)
    assert err.value.body["param"] == "tool_choice"


def test_forcing_a_tool_on_a_model_without_tool_markers_is_a_400():
    with serving() as (url, _):
        with openai_client(url, path="") as c:
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(
                    model="m", messages=user("x"), tools=[WEATHER_TOOL], tool_choice="required"
                )
    assert "tool-call markers" in err.value.body["message"]


def test_top_k_reaches_the_sampler(client, engine):
    client.chat.completions.create(model="fake-model", messages=user("k"), extra_body={"top_k": 20})
    assert engine.submissions[-1].sampling.top_k == 20
