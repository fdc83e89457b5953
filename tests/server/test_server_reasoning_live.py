"""Issue 34 (items 1, 2, 6, 7) with the model users run: a random-weight qwen3_5 hybrid
carrying Qwen3's real tokenizer (`<think>`, `</think>`, `<tool_call>` single tokens),
served with the real Qwen3.5-4B template, whose generation prompt ends inside an open
`<think>`, through the official openai and anthropic SDKs.

A random model never writes a tool call, so agent turns are scripted at the sampler
(requests with a SCRIPTS seed sample the script's tokens, then EOS), as in
test_server_anthropic_prefetch.py; everything else (prefill, decode, routes, cache,
prefetch) is the real path.
"""

from __future__ import annotations

import contextlib
import json

from support.engine_helpers import history_before_tool, scripted_engine, wait_for, wait_stored
from support.live import live_server
from support.paths import DATA

from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.anthropic.bodies import parse_messages_request
from mlx_prefix.server.protocol.messages import conversation_from_dicts
from mlx_prefix.server.protocol.request import Limits

TEMPLATE = DATA / "templates" / "Qwen3.5-4B.jinja"
SYSTEM = "You are a coding agent working in a small repository. Read before editing. " * 4
PATH_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
ASK = "Fix the typo in main.py"
LIMITS = Limits(64, 4096)  # what parse_messages_request checks a body against
MARKUP = (
    "<tool_call>\n<function=Read>\n<parameter=path>\nwrong.py\n</parameter>\n</function>\n"
    "</tool_call>"
)
# Qwen3.5 writes after the `<think>\n` its prompt opened: reasoning (holding call markup,
# which is no call), the close, a sentence, one call in Qwen3-Coder's XML.
# The reasoning as the server hands it out: up to the end marker, without the newline
# before it (the template writes its own when the reasoning comes back).
REASONING = f"I could call {MARKUP} but main.py comes first."
TOOL_REPLY = (
    f"{REASONING}\n</think>\n\nReading it.\n\n"
    "<tool_call>\n<function=Read>\n<parameter=path>\nmain.py\n</parameter>\n</function>\n</tool_call>"
)
SCRIPT_SEED = 8001
ANSWER_REPLY = "The user greets me.\n</think>\n\nHello there."
ANSWER_SEED = 8002


def scripted() -> contextlib.AbstractContextManager[Engine]:
    folder = cached_test_model("qwen3_5", tokenizer=DATA / "tokenizers" / "qwen3")
    model = load_model(str(folder), chat_template=str(TEMPLATE))
    return scripted_engine(model, {SCRIPT_SEED: TOOL_REPLY, ANSWER_SEED: ANSWER_REPLY})


live = live_server(scripted)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def before_tool_result(engine: Engine, messages: list[dict], tools: list[dict]) -> list[int]:
    """The prompt's tokens up to where its first tool result's content begins (a grid
    point): the history and the reply that called the tool, reasoning included."""
    return history_before_tool(
        engine, PromptInput(messages=conversation_from_dicts(messages), tools=tools)
    )


# -- item 1: the prompt's open think block ------------------------------------------------


def test_the_template_opens_reasoning_and_a_forced_call_closes_it(live):
    _, engine = live
    planner = engine.planner
    plain = planner.plan(PromptInput(messages=conversation_from_dicts(user("hi"))))
    assert plain.opens_reasoning
    off = planner.plan(
        PromptInput(
            messages=conversation_from_dicts(user("hi")),
            chat_template_kwargs={"enable_thinking": False},
        )
    )
    assert not off.opens_reasoning
    tools = ({"type": "function", "function": {"name": "Read", "parameters": PATH_SCHEMA}},)
    forced = planner.plan(
        PromptInput(
            messages=conversation_from_dicts(user("hi")),
            tools=tools,
            assistant_prefix="<tool_call>",
        )
    )
    text = engine.model.tokenizer.decode(list(forced.tokens))
    assert text.endswith("<think>\n\n</think>\n\n<tool_call>") and not forced.opens_reasoning


def _reply_text(tokens) -> str:
    """A reply's text from its tokens' texts: the streaming detokenizer drops the space
    a reply's first token starts with (mlx-lm's BPE detokenizer does)."""
    return "".join(tokens).removeprefix(" ")


def test_a_reply_the_prompt_opened_is_reasoning_on_every_api(client, claude):
    r = client.chat.completions.create(
        model="m", messages=user(ASK), max_tokens=8, temperature=0, logprobs=True
    )
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert not message.content and reasoning == message.model_extra["reasoning"]
    assert reasoning == _reply_text(t.token for t in r.choices[0].logprobs.content)
    streamed = client.chat.completions.create(
        model="m", messages=user(ASK), max_tokens=8, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning", "") for d in deltas) == reasoning
    assert not "".join(d.content or "" for d in deltas)
    m = claude.messages.create(
        model="m", max_tokens=8, messages=user(ASK), extra_body={"temperature": 0}
    )
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == reasoning
    hidden = claude.messages.create(
        model="m",
        max_tokens=8,
        messages=user(ASK),
        thinking={"type": "adaptive", "display": "omitted"},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in hidden.content] == ["thinking"] and hidden.content[0].thinking == ""
    resp = client.responses.create(model="m", input=ASK, max_output_tokens=8, temperature=0)
    assert [i.type for i in resp.output] == ["reasoning"]
    assert resp.output[0].content[0].text == reasoning
    assert resp.usage.output_tokens_details.reasoning_tokens == 8


# -- items 1 and 2: an agent's turn with reasoning, on each API ---------------------------


def test_messages_agent_turn(claude, live):
    _, engine = live
    tools = [{"name": "Read", "description": "Read a file.", "input_schema": PATH_SCHEMA}]
    before = engine.prefetch.completed
    ask = dict(model="m", max_tokens=200, system=SYSTEM, tools=tools)
    question = f"{ASK} (messages)"  # each API its own conversation: no shared cache
    first = claude.messages.create(
        **ask, messages=user(question), extra_body={"temperature": 0, "seed": SCRIPT_SEED}
    )
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == REASONING  # its call markup made no call
    assert (first.content[2].name, first.content[2].input) == ("Read", {"path": "main.py"})
    turns = [
        *user(question),
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": first.content[2].id, "content": "x"}
            ],
        },
    ]
    body = {**ask, "messages": turns}  # the next request as the route reads it
    held = history_before_tool(engine, parse_messages_request(body, LIMITS).generation.prompt)
    assert wait_stored(engine, held) and engine.prefetch.completed > before
    second = claude.messages.create(**ask, messages=turns, extra_body={"temperature": 0})
    assert second.usage.cache_read_input_tokens >= len(held)


def test_chat_agent_turn(client, live):
    _, engine = live
    tools = [{"type": "function", "function": {"name": "Read", "parameters": PATH_SCHEMA}}]
    before = engine.prefetch.completed
    messages = [{"role": "system", "content": SYSTEM}, *user(f"{ASK} (chat)")]
    first = client.chat.completions.create(
        model="m", messages=messages, tools=tools, temperature=0, seed=SCRIPT_SEED
    )
    reply = first.choices[0].message
    assert reply.model_extra["reasoning_content"] == REASONING
    assert reply.content.strip() == "Reading it."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.tool_calls] == [
        ("Read", {"path": "main.py"})
    ]
    turns = [
        *messages,
        reply.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "x"},
    ]
    held = before_tool_result(engine, turns, tools)
    assert wait_stored(engine, held) and engine.prefetch.completed > before
    second = client.chat.completions.create(model="m", messages=turns, tools=tools, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(held)


def test_responses_agent_turn(client, live):
    _, engine = live
    tools = [{"type": "function", "name": "Read", "parameters": PATH_SCHEMA}]
    before = engine.prefetch.completed
    question = f"{ASK} (responses)"
    first = client.responses.create(
        model="m",
        instructions=SYSTEM,
        input=question,
        tools=tools,
        temperature=0,
        extra_body={"seed": SCRIPT_SEED},
    )
    assert [i.type for i in first.output] == ["reasoning", "message", "function_call"]
    assert first.output[0].content[0].text == REASONING
    call = first.output[2]
    # Sent back as Codex sends it: the reasoning item without its text (which its
    # encrypted_content carries).
    items = [item.model_dump(exclude_none=True) for item in first.output]
    del items[0]["content"]
    turns = [
        *user(question),
        *items,
        {"type": "function_call_output", "call_id": call.call_id, "output": "x"},
    ]
    chat_tools = [{"type": "function", "function": {"name": "Read", "parameters": PATH_SCHEMA}}]
    history = [
        {"role": "system", "content": SYSTEM},
        *user(question),
        {"role": "assistant", "content": "Reading it.", "reasoning_content": REASONING},
        {"role": "tool", "tool_call_id": call.call_id, "content": "x"},
    ]
    arguments = {"path": "main.py"}
    history[2]["tool_calls"] = [
        {"id": call.call_id, "function": {"name": "Read", "arguments": arguments}}
    ]
    held = before_tool_result(engine, history, chat_tools)
    assert wait_stored(engine, held) and engine.prefetch.completed > before
    second = client.responses.create(
        model="m", instructions=SYSTEM, input=turns, tools=tools, max_output_tokens=4
    )
    assert second.usage.input_tokens_details.cached_tokens >= len(held)


# -- item 6: budgets ---------------------------------------------------------------------


def test_a_spent_budget_closes_the_block_as_the_template_does(client, claude):
    r = client.chat.completions.create(
        model="m",
        messages=user(ASK),
        max_tokens=12,
        temperature=0,
        logprobs=True,
        extra_body={"thinking_token_budget": 3},
    )
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[3:6] == ["\n", "</think>", "\n\n"]  # Qwen3.5's close, forced
    message = r.choices[0].message
    # Without the close's newline: the template writes its own when it comes back.
    assert message.model_extra["reasoning_content"] == _reply_text(tokens[:3])
    assert message.content == ("".join(tokens[6:]).lstrip("\n") or None)  # the answer
    m = claude.messages.create(
        model="m",
        max_tokens=12,
        messages=user(ASK),
        thinking={"type": "enabled", "budget_tokens": 3},  # below Anthropic's 1024 floor
        extra_body={"temperature": 0},
    )
    assert m.content[0].type == "thinking"
    assert m.content[0].thinking == message.model_extra["reasoning_content"]
    off = client.chat.completions.create(
        model="m", messages=user(ASK), max_tokens=4, temperature=0, reasoning_effort="none"
    )
    assert "reasoning_content" not in off.choices[0].message.model_extra
    assert off.choices[0].message.content


# -- item 7: Anthropic's usage -----------------------------------------------------------


def test_anthropic_usage_counts_creation_at_breakpoints_only(claude):
    plain = claude.messages.create(
        model="m",
        max_tokens=2,
        system="Usage probe without breakpoints. " * 8,
        messages=user("count me"),
        extra_body={"temperature": 0},
    )
    count = claude.messages.count_tokens(
        model="m", system="Usage probe without breakpoints. " * 8, messages=user("count me")
    ).input_tokens
    assert plain.usage.cache_read_input_tokens == 0
    assert plain.usage.cache_creation_input_tokens == 0
    assert plain.usage.input_tokens == count
    system = [
        {
            "type": "text",
            "text": "Usage probe with one breakpoint. " * 12,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    with claude.messages.stream(
        model="m",
        max_tokens=2,
        system=system,
        messages=user("count me as well, please, all of these words"),
        extra_body={"temperature": 0},
    ) as stream:
        start = next(e for e in stream if e.type == "message_start")
        final = stream.get_final_message()
    usage = start.message.usage
    assert usage.input_tokens > 0 and usage.cache_creation_input_tokens > 0
    assert final.usage.cache_creation_input_tokens == usage.cache_creation_input_tokens
    total = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    assert (
        total
        == claude.messages.count_tokens(
            model="m", system=system, messages=user("count me as well, please, all of these words")
        ).input_tokens
    )


def test_a_chat_client_sending_back_answers_without_reasoning_is_known_as_a_chat(client, live):
    """The next-turn prefetch of a chat's first turns waits until its client is seen
    sending one of the server's replies back: as its answer, without the reasoning."""
    _, engine = live
    system = {"role": "system", "content": "A chat app's own system prompt. " * 4}
    ask = dict(model="m", max_tokens=16, temperature=0)
    known = engine.prefetcher.chat_traffic.chat_clients
    first = client.chat.completions.create(**ask, messages=[system, *user("Hi")], seed=ANSWER_SEED)
    reply = first.choices[0].message
    assert reply.content == "Hello there." and reply.model_extra["reasoning_content"]
    back = {"role": "assistant", "content": reply.content}
    client.chat.completions.create(**ask, messages=[system, *user("Hi"), back, *user("q2")])
    assert wait_for(lambda: engine.prefetcher.chat_traffic.chat_clients == known + 1)


def test_gpt_oss_renders_reasoning_sent_back_as_its_analysis_channel():
    from mlx_lm.utils import load_tokenizer

    from mlx_prefix.prompt.request.render import ChatRenderer

    folder = cached_test_model("qwen3_5", tokenizer=DATA / "tokenizers" / "qwen3")
    template = (DATA / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    renderer = ChatRenderer(load_tokenizer(folder, {"chat_template": template}))
    call = {"id": "c1", "function": {"name": "Read", "arguments": {"path": "a"}}}
    messages = [
        *user(ASK),
        {"role": "assistant", "content": "", "reasoning": "Look first.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]
    read = {"name": "Read", "description": "Read a file.", "parameters": PATH_SCHEMA}
    tools = [{"type": "function", "function": read}]
    text = renderer.render_text(conversation_from_dicts(messages), tools=tools)
    assert "<|start|>assistant<|channel|>analysis<|message|>Look first.<|end|>" in text
