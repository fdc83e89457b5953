"""gpt-oss's harmony replies read apart (prompt/reply/harmony.py, reader.py): the analysis
channel is reasoning, a commentary message to a function is a call, the rest is text,
whatever deltas the reply arrives in, and no control token reaches the client."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
from mlx_lm.utils import load_tokenizer
from support.template_models import DATA, GPT_OSS_TOKENIZER, QWEN3_TOKENIZER

from mlx_prefix.conversation import Message
from mlx_prefix.prompt.reply import harmony
from mlx_prefix.prompt.reply.harmony import CONTROL, Harmony, HarmonyReader
from mlx_prefix.prompt.reply.reader import (
    ReplyFormat,
    answer_text,
    client_reply,
    reply_reader,
    tool_syntax,
)
from mlx_prefix.prompt.reply.reasoning import ReasoningMarkers, _probe_renders, _template_close
from mlx_prefix.prompt.reply.thinking import NO_EDGES
from mlx_prefix.prompt.reply.tool_calls import CallParser, Split
from mlx_prefix.prompt.request.render import ChatRenderer
from mlx_prefix.records import ToolCallIds

TEMPLATE = (DATA / "templates" / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
ANALYSIS = "<|channel|>analysis<|message|>I could call to=functions.read {} but no.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It prints hello.<|return|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.read <|constrain|>json"
    '<|message|>{"path": "a.py"}'
)
# The recipient after the role, as the template renders calls.
ROLE_CALL = (
    '<|start|>assistant to=functions.read<|channel|>commentary json<|message|>{"path": "a.py"}'
)


def tokenizer_of(source, tmp_path):
    folder = tmp_path / source.name
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(
        gzip.decompress((source / "tokenizer.json.gz").read_bytes())
    )
    shutil.copyfile(source / "tokenizer_config.json", folder / "tokenizer_config.json")
    return load_tokenizer(folder, {"chat_template": TEMPLATE})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return tokenizer_of(GPT_OSS_TOKENIZER, tmp_path_factory.mktemp("tok"))


def read(reply: str, cuts: int | None = None, calls: bool = True) -> Split:
    """The whole reply read in deltas of `cuts` characters (None: one delta)."""
    reader = HarmonyReader(calls=calls)
    size = cuts or len(reply) or 1
    parts = [reader.feed(reply[i : i + size]) for i in range(0, len(reply), size)]
    parts.append(reader.finish())
    return Split(
        "".join(p.text for p in parts),
        [c for p in parts for c in p.calls],
        "".join(p.reasoning for p in parts),
    )


def clean(split: Split) -> bool:
    return not any(t in split.text or t in split.reasoning for t in CONTROL)


@pytest.mark.parametrize("cuts", [None, 1, 2, 5])
def test_analysis_is_reasoning_and_final_is_text_however_cut(cuts):
    split = read(ANALYSIS + FINAL, cuts)
    assert split.reasoning == "I could call to=functions.read {} but no."
    assert split.text == "It prints hello." and split.calls == [] and clean(split)


@pytest.mark.parametrize("cuts", [None, 1, 3])
@pytest.mark.parametrize("call", [CALL, ROLE_CALL])
def test_a_message_to_a_function_is_a_call(call, cuts):
    # <|call|> is a stop token: the reply's text ends with the arguments.
    split = read(ANALYSIS + call, cuts)
    assert split.reasoning.startswith("I could call") and split.text == "" and clean(split)
    calls, failed = CallParser(harmony.SYNTAX, TOOLS, ToolCallIds("r")).parse(split.calls)
    assert failed == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("read", {"path": "a.py"})
    ]


def test_no_call_inside_reasoning_and_none_without_tools():
    to_function = '<|channel|>analysis to=functions.read<|message|>{"path": "b.py"}<|end|>'
    split = read(to_function + CALL + "<|call|>")
    assert split.reasoning == '{"path": "b.py"}' and len(split.calls) == 1
    builtin = '<|channel|>analysis to=browser.search<|message|>{"q": 1}<|end|>' + FINAL
    assert read(builtin).reasoning == '{"q": 1}' and read(builtin).calls == []
    plain = read(ANALYSIS + CALL, calls=False)  # tools not offered: the arguments are text
    assert plain.calls == [] and plain.text == '{"path": "a.py"}'


def test_a_preamble_is_text_and_a_reply_without_headers_is_plain_text():
    preamble = "<|channel|>commentary<|message|>Let me look.<|end|>" + CALL
    split = read(preamble)
    assert split.text == "Let me look." and len(split.calls) == 1
    assert read("Hello there", 1).text == "Hello there"
    assert read("today is fine", 1).text == "today is fine"


def test_a_call_cut_short_is_its_arguments_as_text():
    split = read(ANALYSIS + CALL[:-6])
    calls, failed = CallParser(harmony.SYNTAX, TOOLS, ToolCallIds("r")).parse(split.calls)
    assert calls == [] and failed == '{"path": "'


def test_harmony_is_known_by_its_template_and_single_control_tokens(gpt_oss, tmp_path):
    found = Harmony.of(gpt_oss)
    assert found is not None
    assert [gpt_oss.decode([t]) for t in found.stops] == ["<|return|>", "<|call|>"]
    assert tool_syntax(gpt_oss) is harmony.SYNTAX
    qwen3 = tokenizer_of(QWEN3_TOKENIZER, tmp_path)  # the same template, no harmony tokens
    assert Harmony.of(qwen3) is None and tool_syntax(qwen3) is None


def test_the_reasoning_markers_are_the_analysis_message_and_close_as_the_template(gpt_oss):
    renderer = ChatRenderer(gpt_oss)
    markers = ReasoningMarkers.of(renderer)
    assert markers is not None
    assert gpt_oss.decode(list(markers.start)) == harmony.ANALYSIS
    assert gpt_oss.decode(list(markers.end)) == "<|end|>"
    # The close a budget forces is the template's own, between reasoning and answer.
    close = _template_close(_probe_renders(renderer), "<|end|>")
    assert markers.close_text == harmony.CLOSE == close
    # The analysis message comes back as the model wrote it: no edges dropped.
    assert markers.reply_edges(opened=False) == markers.reply_edges(opened=True) == NO_EDGES
    prompt = renderer.encode_chat(
        renderer.render_text([Message("user", "hi")], add_generation_prompt=True)
    )
    assert not markers.opens(prompt)


def test_the_client_reply_and_the_answer_read_as_the_server_does(gpt_oss):
    reader = reply_reader(ReplyFormat.of(gpt_oss), harmony.SYNTAX)
    turn = client_reply(harmony.SYNTAX, ANALYSIS + CALL, TOOLS, ToolCallIds("r"), reader)
    assert turn.message.reasoning.startswith("I could call")
    assert turn.message.content == ""
    [call] = turn.message.tool_calls
    assert call.name == "read" and turn.call_ids == (call.id,)
    assert (
        answer_text(ReplyFormat.of(gpt_oss), ANALYSIS + FINAL, opened=False) == "It prints hello."
    )
    forced = reply_reader(
        ReplyFormat.of(gpt_oss), harmony.SYNTAX, prefix=harmony.named_opening("read")
    )
    assert forced.feed('{"path": "a.py"}').calls == [] and forced.finish().calls == [
        'read<|message|>{"path": "a.py"}'
    ]


def test_a_forced_call_opens_the_commentary_channel_to_the_function(gpt_oss):
    from mlx_prefix.server.protocol.request import ToolChoice
    from mlx_prefix.server.routes.tool_choice import forced_opening

    named = forced_opening(tool_syntax(gpt_oss), ToolChoice(mode="named", name="read"))
    assert named == "<|channel|>commentary to=functions.read <|constrain|>json<|message|>"
    required = forced_opening(tool_syntax(gpt_oss), ToolChoice(mode="required"))
    reader = reply_reader(ReplyFormat.of(gpt_oss), harmony.SYNTAX, prefix=required)
    reader.feed('read <|constrain|>json<|message|>{"path": "a.py"}')
    assert reader.finish().calls == ['read<|message|>{"path": "a.py"}']
