"""Next-turn prefetch of replies that call tools: the reply is rendered as the client sends
it back (an assistant message with structured calls, named as the server named them,
then the tools' results), so an agent's tool loop restores its whole history."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer
from support.engine_helpers import open_engine, wait_for, warm_equals_cold
from support.models import TEST_CACHE, loaded_test_model
from support.template_models import ID_TEMPLATE

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.keys import entry_key
from mlx_prefix.engine.requests.prefetch import NextTurn, next_turn_prompt
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.reply.reader import ReplyFormat
from mlx_prefix.prompt.reply.tool_calls import ToolSyntax
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.records import (
    CachePreference,
    DoneEvent,
    PromptInput,
    TokenEvent,
    ToolCallIds,
    Usage,
)
from mlx_prefix.server.protocol.chat import parse_chat
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.server.protocol.request import GenerationRequest, Limits
from mlx_prefix.server.protocol.responses.bodies import parse_responses
from mlx_prefix.server.protocol.responses.items import reply_messages
from mlx_prefix.server.replies.assembler import Assembler
from mlx_prefix.server.replies.responses import OutputEvents, ReplyMeta

NOW = EngineConfig(prefetch_delay_s=0.0)
LIMITS = Limits(default_max_tokens=16, max_tokens=1000)
SYSTEM = "You are a coding agent. Use the tools to answer; be brief. " * 3
QUESTION = "What is the weather in Paris and Oslo?"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# What a Qwen3-style model writes: reasoning, then two calls (parsed by mlx-lm's
# json_tools parser, which the test template's tokenizer gets, as a real Qwen3's does).
TOOL_REPLY = (
    "<think>\nI need the weather in both cities.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def chat_request(messages: list[dict], ids: ToolCallIds) -> GenerationRequest:
    """A chat body with tools, parsed as the route parses it and named as it names it."""
    parsed = parse_chat({"model": "m", "messages": messages, "tools": [WEATHER]}, LIMITS)
    return replace(parsed, prompt=replace(parsed.prompt, reply_tool_call_ids=ids))


def served_message(tokenizer, request: GenerationRequest, reply: str) -> dict:
    """The assistant message the chat route answers for `reply`, through its Assembler
    (the reply fed in 3-character deltas, as the engine streams it)."""
    assembler = Assembler.for_request(
        request, ReplyFormat.of(tokenizer), tokenizer, streaming=False
    )
    deltas = [assembler.feed(TokenEvent(reply[i : i + 3], 1)) for i in range(0, len(reply), 3)]
    deltas.append(assembler.finish())
    calls = [call for d in deltas for call in d.tool_calls]
    message = {"role": "assistant", "content": "".join(d.text for d in deltas), "tool_calls": calls}
    reasoning = "".join(d.reasoning for d in deltas)
    if reasoning:  # the reply's reasoning_content, sent back as received
        message["reasoning_content"] = reasoning
    return message


def tool_loop(tokenizer, ids: ToolCallIds) -> tuple[GenerationRequest, PromptInput]:
    """The first request of a tool loop, and the next one: the client sends back the
    served message with its calls, and one result per call."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = chat_request(history, ids)
    answer = served_message(tokenizer, first, TOOL_REPLY)
    assert [c["id"] for c in answer["tool_calls"]] == [ids.id(0), ids.id(1)]
    results = [
        {"role": "tool", "tool_call_id": call["id"], "content": f"{city}: 18C, sunny"}
        for call, city in zip(answer["tool_calls"], ("Paris", "Oslo"), strict=True)
    ]
    return first, chat_request([*history, answer, *results], ToolCallIds("next")).prompt


def first_result_start(planner: PromptPlanner, prompt: PromptInput) -> int:
    """Where the first tool result begins (on the grid): the planner's last-message point
    of the conversation cut just after it."""
    assert prompt.messages is not None
    first = next(i for i, m in enumerate(prompt.messages) if m.role == "tool")
    cut = PromptInput(messages=prompt.messages[: first + 1], tools=prompt.tools)
    return max(c.position for c in planner.plan(cut).checkpoints if c.kind.name == "LAST_MESSAGE")


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_tool_loop_restores_its_whole_history_and_answers_like_a_cold_run(kind):
    model = loaded_test_model(kind, think_template=True)
    assert model.tokenizer.has_tool_calling
    with open_engine(model, TEST_CACHE, NOW) as engine:
        ids = ToolCallIds("chatcmpl-first-turn")
        first, nxt = tool_loop(model.tokenizer, ids)
        computed = len(engine.plan(first.prompt).tokens)
        # What the engine's reply hook (decode -> _maybe_prefetch) does with this reply.
        key = entry_key(engine.model_key, CachePreference())
        engine.prefetcher.submit(
            NextTurn(first.prompt, TOOL_REPLY, computed, "chatcmpl-first-turn", key)
        )
        assert wait_for(lambda: engine.prefetch.completed == 1)

        result = warm_equals_cold(engine, nxt)
        # Restored up to the tool results: the reply and its calls came from the prefetch.
        assert result.usage.cached_tokens >= first_result_start(engine.planner, nxt)
        assert result.usage.cached_tokens > computed
        engine.store.check_integrity()


@pytest.fixture(scope="module")
def id_tokenizer(tmp_path_factory):
    for edit in ("set call_id", "+ call_id +", "<tool_response id="):
        assert edit in ID_TEMPLATE
    folder = Path(tmp_path_factory.mktemp("ids")) / "model"
    shutil.copytree(cached_test_model("dense", think_template=True), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ID_TEMPLATE
    config_path.write_text(json.dumps(config))
    return load_tokenizer(folder)


def test_templates_that_print_call_ids_get_the_ids_the_client_received(id_tokenizer):
    planner = PromptPlanner(id_tokenizer, TEST_CACHE)
    syntax = ToolSyntax.of(id_tokenizer)
    ids = ToolCallIds("chatcmpl-ids")
    first, nxt = tool_loop(id_tokenizer, ids)
    rendered = planner.plan(nxt).tokens
    assert ids.id(0) in id_tokenizer.decode(list(rendered))

    prefetched = next_turn_prompt(planner, first.prompt, TOOL_REPLY, 0, syntax, "chatcmpl-ids")
    assert prefetched is not None
    assert rendered[: len(prefetched.tokens)] == prefetched.tokens
    assert len(prefetched.tokens) == first_result_start(planner, nxt)

    # Ids other than the ones the client received (random ones, as before) would not match.
    elsewhere = replace(first.prompt, reply_tool_call_ids=ToolCallIds("another-request"))
    stale = next_turn_prompt(planner, elsewhere, TOOL_REPLY, 0, syntax, "chatcmpl-ids")
    assert stale is not None and rendered[: len(stale.tokens)] != stale.tokens


def test_without_tools_offered_a_tool_call_reply_comes_back_as_text():
    tokenizer = loaded_test_model("dense", think_template=True).tokenizer
    planner = PromptPlanner(tokenizer, TEST_CACHE)
    history = (
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": QUESTION},
    )
    # The server parses calls only when tools were offered; otherwise the client gets the
    # markup as text and sends it back so.
    source = PromptInput(messages=conversation_from_dicts(history))
    syntax = ToolSyntax.of(tokenizer)
    prefetched = next_turn_prompt(planner, source, TOOL_REPLY, 0, syntax, "r")
    assert prefetched is not None
    reply = {"role": "assistant", "content": TOOL_REPLY}
    nxt = PromptInput(
        messages=conversation_from_dicts([*history, reply, {"role": "user", "content": "Thanks"}])
    )
    assert planner.plan(nxt).tokens[: len(prefetched.tokens)] == prefetched.tokens


def responses_next_turn(tokenizer, ids: ToolCallIds) -> tuple[PromptInput, PromptInput]:
    """The same tool loop over /v1/responses: the reply's output items (built by the
    route's own Assembler and OutputEvents) sent back as input items with the results,
    and the same turn chained by previous_response_id instead."""
    flat = {"type": "function", "name": "get_weather", **WEATHER["function"], "strict": False}
    first = parse_responses(
        {"model": "m", "instructions": SYSTEM, "input": QUESTION, "tools": [flat]}, LIMITS
    )
    syntax = ToolSyntax.of(tokenizer)
    assert syntax is not None
    assembler = Assembler.for_request(
        first.generation((), ids), ReplyFormat.of(tokenizer), tokenizer, streaming=False
    )
    head = ReplyMeta(ids.seed, "m", SYSTEM, None, None, True, 0.0, 1.0, {})
    output = OutputEvents(head, logprobs=False, single_call=False)
    for i in range(0, len(TOOL_REPLY), 3):
        output.add(assembler.feed(TokenEvent(TOOL_REPLY[i : i + 3], 1)))
    output.add(assembler.finish())
    done = output.finish(DoneEvent("stop", Usage(1, 1, 0, 0.0, 0.0, 0.0)))[-1]["response"]
    items = done["output"]
    assert [item["type"] for item in items] == ["reasoning", "function_call", "function_call"]
    results = [
        {"type": "function_call_output", "call_id": c["call_id"], "output": f"{city}: 18C, sunny"}
        for c, city in zip(items[1:], ("Paris", "Oslo"), strict=True)
    ]
    sent_back = parse_responses(
        {"model": "m", "instructions": SYSTEM, "tools": [flat],
         "input": [{"role": "user", "content": QUESTION}, *items, *results]},
        LIMITS,
    )  # fmt: skip
    chained = parse_responses(
        {"model": "m", "instructions": SYSTEM, "tools": [flat], "input": results}, LIMITS
    )
    history = (*first.input, *reply_messages(items))
    return sent_back.prompt((), ids), chained.prompt(history, ids)


def test_every_api_shape_sends_back_the_conversation_the_prefetch_rendered():
    tokenizer = loaded_test_model("dense", think_template=True).tokenizer
    planner = PromptPlanner(tokenizer, TEST_CACHE)
    ids = ToolCallIds("resp_first_turn")
    first, chat_next = tool_loop(tokenizer, ids)
    prefetched = next_turn_prompt(planner, first.prompt, TOOL_REPLY, 0, ToolSyntax.of(tokenizer))
    assert prefetched is not None
    chat_tokens = planner.plan(chat_next).tokens
    assert chat_tokens[: len(prefetched.tokens)] == prefetched.tokens
    assert len(prefetched.tokens) == first_result_start(planner, chat_next)
    for responses_next in responses_next_turn(tokenizer, ids):
        assert planner.plan(responses_next).tokens == chat_tokens
