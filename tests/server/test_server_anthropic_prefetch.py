"""Issue 13, item 5 over /v1/messages: a reply that calls tools is prefetched as the
client will send it back (its tool_use ids named after the message, its reasoning as a
thinking block, whitespace between its calls dropped), so an agent's next turn, sent
through the official anthropic SDK, restores its whole history from the cache and
answers exactly as a cold run does.

A tiny random model never writes a tool call, so the first turn's reply is scripted at
the sampler: requests with a SCRIPTS seed sample the script's tokens, then EOS. The
prefill, the decode through the model, the route, the cache and the prefetch are the
real ones; the follow-up turns sample from the model as usual.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from support.engine_helpers import history_before_tool, scripted_engine, wait_stored
from support.live import live_server
from support.models import loaded_test_model
from support.template_models import ID_TEMPLATE

from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import PromptInput, ToolCallIds
from mlx_prefix.server.protocol.anthropic.bodies import parse_messages_request
from mlx_prefix.server.protocol.request import Limits

SYSTEM = "You are a coding agent working in a small repository. Read before editing. " * 4
TOOLS = [
    {
        "name": name,
        "description": f"{name} a file in the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name in ("Read", "Edit")
]
ASK = [{"role": "user", "content": "Fix the typos in main.py and util.py"}]
# What a Qwen3-style model writes: reasoning, a sentence, two calls with a newline between.
TOOL_REPLY = (
    "<think>\nI should read both files.\n</think>\n\nReading both.\n"
    '<tool_call>\n{"name": "Read", "arguments": {"path": "main.py"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "Read", "arguments": {"path": "util.py"}}\n</tool_call>'
)
# A forced call to Read (tool_choice {"type": "tool"}) opens the turn with
# '<tool_call>\n{"name": "Read", "arguments": '; the model continues it.
FORCED_REPLY = '{"path": "main.py"}}\n</tool_call>\n<tool_call>'
SCRIPTS = {7001: TOOL_REPLY, 7002: FORCED_REPLY}
COLD = {"temperature": 0, "prefix_cache": {"enabled": False}}


def id_model(folder):
    """The dense test model with a template that prints tool-call ids (as Kimi's and
    Mistral's do): the prefetch must render the ids the client received."""
    shutil.copytree(cached_test_model("dense", think_template=True), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ID_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_model(str(folder))


@contextlib.contextmanager
def scripted(kind: str) -> Iterator[Engine]:
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "dense-printing-ids":
            model = id_model(Path(tmp) / "model")
        else:
            model = loaded_test_model(kind, think_template=True)
        with scripted_engine(model, SCRIPTS) as engine:
            yield engine


live = live_server(scripted, params=["dense", "qwen3_5", "dense-printing-ids"])


def sent_back(message) -> list[dict]:
    """The reply's content blocks as a client sends them back (plain JSON)."""
    return [block.model_dump(exclude_none=True) for block in message.content]


def results(message) -> dict:
    blocks = [
        {"type": "tool_result", "tool_use_id": b.id, "content": f"{b.input['path']}: 3 lines"}
        for b in message.content
        if b.type == "tool_use"
    ]
    return {"role": "user", "content": blocks}


def next_prompt(messages: list[dict]) -> PromptInput:
    """The next request's prompt, as the route parses it."""
    body = {"model": "m", "max_tokens": 8, "system": SYSTEM, "tools": TOOLS, "messages": messages}
    return parse_messages_request(body, Limits(64, 4096)).generation.prompt


def follow_up(client, engine, first, messages: list[dict], prefetched: int) -> None:
    """The next turn reads the prefetched prefix, past the tool_use turn, and answers as
    a cold run."""
    prompt = next_prompt(messages)
    if engine.model.tokenizer.chat_template == ID_TEMPLATE:
        text = engine.planner.renderer.render_text(prompt.messages, tools=prompt.tools)
        assert all(b.id in text for b in first.content if b.type == "tool_use")
    # The prefetch of this reply stored the tool_use turn (a count would be met by the
    # last test's follow-up's own late prefetch).
    held = history_before_tool(engine, prompt)
    assert wait_stored(engine, held) and engine.prefetch.completed >= prefetched
    ask = dict(model="claude-local", max_tokens=6, system=SYSTEM, tools=TOOLS)
    warm = client.messages.create(**ask, messages=messages, extra_body={"temperature": 0})
    usage = first.usage
    first_prompt = usage.input_tokens + usage.cache_read_input_tokens
    first_prompt += usage.cache_creation_input_tokens
    # Beyond the first request's prompt: the reply's tokens came from the prefetch.
    assert warm.usage.cache_read_input_tokens > first_prompt
    assert warm.usage.cache_read_input_tokens >= len(held)
    cold = client.messages.create(**ask, messages=messages, extra_body=COLD)
    assert cold.usage.cache_read_input_tokens == 0
    assert sent_back(warm) == sent_back(cold)
    engine.store.check_integrity()


def test_a_tool_use_reply_is_prefetched_as_the_sdk_sends_it_back(claude, engine):
    before = engine.prefetch.completed
    first = claude.messages.create(
        model="claude-local",
        max_tokens=200,
        system=SYSTEM,
        tools=TOOLS,
        messages=ASK,
        extra_body={"temperature": 0, "seed": 7001},
    )
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert first.content[0].thinking.strip() == "I should read both files."
    assert first.content[1].text == "Reading both.\n"  # the newline between calls dropped
    ids = ToolCallIds(first.id, prefix="toolu_")
    assert [b.id for b in first.content[2:]] == [ids.id(0), ids.id(1)]
    assert [b.input for b in first.content[2:]] == [{"path": "main.py"}, {"path": "util.py"}]
    turns = [*ASK, {"role": "assistant", "content": sent_back(first)}, results(first)]
    follow_up(claude, engine, first, turns, before + 1)


def test_a_forced_streamed_call_is_prefetched_with_its_opening(claude, engine):
    before = engine.prefetch.completed
    forced = {"type": "tool", "name": "Read", "disable_parallel_tool_use": True}
    with claude.messages.stream(
        model="claude-local",
        max_tokens=200,
        system=SYSTEM,
        tools=TOOLS,
        tool_choice=forced,
        messages=ASK,
        extra_body={"temperature": 0, "seed": 7002},
    ) as stream:
        first = stream.get_final_message()
    # One call: the reply stopped at the call's end marker, before the second opened.
    assert first.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in first.content] == [
        ("tool_use", "Read", {"path": "main.py"})
    ]
    assert first.content[0].id == ToolCallIds(first.id, prefix="toolu_").id(0)
    turns = [*ASK, {"role": "assistant", "content": sent_back(first)}, results(first)]
    follow_up(claude, engine, first, turns, before + 1)
