"""Pure pieces of the server: request parsing, tool-call splitting, chunk shapes."""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import pytest
from support.server_fakes import FakeTokenizer

from mlx_prefix.conversation import Message
from mlx_prefix.engine.decode.sampling import TokenSampler, normalize
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import SamplingParams, ToolCallIds, Usage
from mlx_prefix.server import ServerSettings
from mlx_prefix.server.protocol.chat import parse_chat, parse_messages
from mlx_prefix.server.protocol.completions import parse_completion
from mlx_prefix.server.protocol.fields import parse_json_object
from mlx_prefix.server.protocol.request import Limits
from mlx_prefix.server.replies import chat as R
from mlx_prefix.server.replies.assembler import Alternative, TokenLogprob
from mlx_prefix.server.replies.ids import new_id
from mlx_prefix.server.replies.tools import ToolCallFormatter, ToolCallSplitter, ToolSyntax

LIMITS = Limits(default_max_tokens=64, max_tokens=1000)
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def syntax() -> ToolSyntax:
    found = ToolSyntax.of(FakeTokenizer.with_json_tools())
    assert found is not None
    return found


def split_all(deltas: list[str]) -> tuple[str, list[str]]:
    splitter = ToolCallSplitter(syntax())
    text, calls = [], []
    for d in deltas:
        part = splitter.feed(d)
        text.append(part.text)
        calls.extend(part.calls)
    part = splitter.finish()
    return "".join(text) + part.text, calls + part.calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_splitter_any_delta_boundaries(step):
    reply = f"before {CALL} between <tool{CALL}after <tool_"
    deltas = [reply[i : i + step] for i in range(0, len(reply), step)]
    text, calls = split_all(deltas)
    assert text == "before  between <toolafter <tool_"
    assert calls == ['{"name": "f", "arguments": {"x": 1}}'] * 2


def test_splitter_never_leaks_a_marker_prefix_early():
    splitter = ToolCallSplitter(syntax())
    assert splitter.feed("Hi <tool_ca").text == "Hi "
    assert splitter.feed('ll>{"name"').text == ""
    assert splitter.feed(': "f"}</tool_call> ok').calls == ['{"name": "f"}']


def test_unterminated_call_is_offered_to_the_parser():
    text, calls = split_all(['<tool_call>{"name": "f", "arguments": {}}'])
    assert (text, calls) == ("", ['{"name": "f", "arguments": {}}'])


def test_formatter_openai_shape_and_bad_calls_as_text():
    ids = ToolCallIds("chatcmpl-1")
    fmt = ToolCallFormatter(syntax(), tools=None, streaming=True, ids=ids)
    calls, failed = fmt.format(['{"name": "f", "arguments": {"x": 1}}', "{oops", '{"name": "g"}'])
    assert [c["index"] for c in calls] == [0, 1]
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    # Named after the request, so the engine's prefetch knows the ids the client receives.
    assert [c["id"] for c in calls] == [ids.id(0), ids.id(1)]
    assert failed == "<tool_call>{oops</tool_call>"


def test_no_tool_syntax_without_tool_calling():
    assert ToolSyntax.of(FakeTokenizer()) is None


def test_messages_normalized():
    (m,) = parse_messages(
        [{"role": "user", "content": [{"type": "text", "text": "a"}], "name": "n"}]
    )
    assert m == Message("user", "a", name="n")


def test_developer_role_renders_as_system():
    (m,) = parse_messages([{"role": "developer", "content": "rules"}])
    assert m == Message("system", "rules")


def test_parse_chat_defaults_and_overrides():
    req = parse_chat({"messages": [{"role": "user", "content": "x"}]}, LIMITS)
    assert req.sampling.max_tokens == 64 and req.sampling.temperature == 0.0
    assert req.model is None and not req.stream and not req.include_usage
    req = parse_chat(
        {
            "messages": [{"role": "developer", "content": "x"}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 0,
        },
        LIMITS,
    )
    assert req.sampling.max_tokens == 7  # the newer name wins
    assert req.max_tokens_param == "max_completion_tokens"
    assert req.include_usage and req.sampling.logprobs


def test_top_logprobs_are_honoured_with_logprobs_only():
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    sampling = parse_chat(body, LIMITS).sampling
    assert sampling.logprobs and sampling.top_logprobs == 2
    with pytest.raises(InvalidRequest, match="requires logprobs") as e:
        parse_chat({**body, "logprobs": False}, LIMITS)
    assert e.value.param == "top_logprobs"


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_seed_range_accepted_and_the_sampler_takes_it(seed):
    body = {"messages": [{"role": "user", "content": "x"}], "seed": seed, "temperature": 1.0}
    sampling = parse_chat(body, LIMITS).sampling
    assert sampling.seed == seed
    TokenSampler(sampling)  # mx.random.key takes it


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30])
def test_seed_out_of_range(seed):
    with pytest.raises(InvalidRequest, match="'seed' must be between") as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "seed": seed}, LIMITS)
    assert e.value.param == "seed"


def test_top_p_zero_is_greedy():
    # sampling.py is tested here: it decides what a top_p the protocol accepts means.
    logits = mx.array([[0.0, 0.1, 0.2, 0.3, 0.25, 0.1, 0.0, 0.05]])  # [1, V], argmax 3
    logprobs = normalize(logits)
    for top_p, temperature in ((0.0, 1.0), (0.0, 2.0), (1.0, 0.0)):
        params = parse_chat(
            {"messages": [{"role": "user", "content": "x"}], "top_p": top_p,
             "temperature": temperature},
            LIMITS,
        ).sampling  # fmt: skip
        for seed in range(16):
            sampler = TokenSampler(replace(params, seed=seed))
            assert sampler.greedy and sampler(logprobs).item() == 3
    sampled = {
        TokenSampler(SamplingParams(temperature=1.0, seed=s))(logprobs).item() for s in range(16)
    }
    assert len(sampled) > 1  # the same logits do get sampled when top_p > 0


def test_max_tokens_param_is_none_for_the_default():
    req = parse_completion({"prompt": "x"}, LIMITS)
    assert req.max_tokens_param is None and req.sampling.max_tokens == 64
    assert (
        parse_completion({"prompt": "x", "max_tokens": 3}, LIMITS).max_tokens_param == "max_tokens"
    )


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_number_message(value):
    raw = f'{{"prompt": "x", "temperature": {value}}}'.encode()
    with pytest.raises(InvalidRequest) as e:
        parse_completion(parse_json_object(raw), LIMITS)
    assert e.value.param == "temperature"
    assert "must be a finite number, got" in e.value.message
    assert "not number" not in e.value.message


@pytest.mark.parametrize(
    "raw,match",
    [
        (b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested too deeply"),
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"prompt": "x", "stop": [' + b"1" * 5000 + b"]}", "not valid JSON"),
    ],
    ids=["200k deep", "5000-digit seed", "5000-digit in a list"],
)
def test_json_the_parser_cannot_hold_is_invalid_request(raw, match):
    with pytest.raises(InvalidRequest, match=match):
        parse_json_object(raw)


@pytest.mark.parametrize(
    "raw,param",
    [
        (rb'{"prompt": "a\ud800b"}', "prompt"),
        (rb'{"messages": [{"role": "user", "content": "\udfff"}]}', "messages[0].content"),
        (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\uDBFF"}]}]}',
         "messages[0].content[0].text"),
        (rb'{"prompt": "x", "\ud800": 1}', None),
    ],
)  # fmt: skip
def test_lone_surrogate_is_rejected_at_parse_time(raw, param):
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as e:
        parse_json_object(raw)
    assert e.value.param == param


def test_escaped_text_that_is_valid_unicode_passes():
    body = parse_json_object(rb'{"prompt": "\ud83d\ude00 and \\ud800 and \u00e9"}')
    assert body["prompt"] == "\U0001f600 and \\ud800 and \u00e9"
    args = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (m,) = parse_messages(
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}]
    )
    assert m.tool_calls[0].arguments == args  # kept as the string it was


def test_include_usage_needs_stream():
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert parse_completion(body, LIMITS).include_usage is False


def test_completion_logprobs_int():
    # N: the sampled tokens' logprobs and N alternatives; 0 (or true): no alternatives.
    for value, on, top in ((2, True, 2), (0, True, 0), (True, True, 0), (None, False, 0)):
        sampling = parse_completion({"prompt": "x", "logprobs": value}, LIMITS).sampling
        assert (sampling.logprobs, sampling.top_logprobs) == (on, top), value
    assert not parse_completion({"prompt": "x", "logprobs": False}, LIMITS).sampling.logprobs
    with pytest.raises(InvalidRequest):
        parse_completion({"prompt": "x", "logprobs": "2"}, LIMITS)


def test_chunks_and_usage_shapes():
    meta = R.ReplyMeta("chat", "m", new_id("chatcmpl-"))
    usage = Usage(3, 2, 1, 0.1, 10.0, 5.0)
    body = R.completion_body(
        meta, text="", tool_calls=[], finish_reason="stop", usage=usage, logprobs=None
    )
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None}
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    raw = R.sse(R.usage_chunk(meta, usage))
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[6:])["choices"] == []
    alt = (Alternative("x", -0.5), Alternative("a", -1.0))
    lps = [TokenLogprob("a", -1.0, alt), TokenLogprob("bc", -2.0)]
    assert R.logprobs_body("completion", lps) == {
        "tokens": ["a", "bc"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"x": -0.5, "a": -1.0}, {"bc": -2.0}],  # the sampled one always
        "text_offset": [0, 1],
    }
    (first, second) = R.logprobs_body("chat", lps)["content"]
    assert first["top_logprobs"] == [
        {"token": "x", "logprob": -0.5, "bytes": [120]},
        {"token": "a", "logprob": -1.0, "bytes": [97]},
    ]
    assert second == {"token": "bc", "logprob": -2.0, "bytes": [98, 99], "top_logprobs": []}


def test_settings_validate_origins():
    assert ServerSettings(
        allowed_origins="https://a.example, https://b.example/"
    ).allowed_origins == (
        "https://a.example",
        "https://b.example",
    )
    with pytest.raises(ValueError, match="not an origin"):
        ServerSettings(allowed_origins=tuple("https://a.example"))
