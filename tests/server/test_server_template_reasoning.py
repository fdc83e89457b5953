"""Reasoning per model family (issue 34, item 4): for every family whose template opens
reasoning in the generation prompt or whose models write it, a reply with reasoning,
written as that family's model writes it, lands in the reasoning field on chat
completions, the `thinking` block on Anthropic Messages and the `reasoning` item on
Responses; tool-call markup inside the reasoning makes no call, and the call after it
makes one. gpt-oss replies in harmony channels, ended by `<|call|>` (a stop token).

The real templates and tokenizers of tests/support/template_models.py on a tiny random-weight
model; the reply is scripted at the sampler (a request with SEED samples the script's
tokens, then EOS), everything else is the real path.
"""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import pytest
from support.live import anthropic_client, openai_client
from support.models import TEST_CACHE
from support.server_fakes import serving
from support.template_models import REASONING_FAMILIES, TOOLS, calibrated_once, call, template_model

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.decode import arrival
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.engine import Engine
from mlx_prefix.engine.requests.prefetch import next_turn_prompt
from mlx_prefix.prompt.reply.harmony import CONTROL, Harmony
from mlx_prefix.prompt.reply.reader import tool_syntax
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts

SEED, BUDGET_SEED = 9001, 9002
QUESTION = [{"role": "user", "content": "What does a.py print?"}]
ANSWER = "Reading it."


class ScriptedSampler(TokenSampler):
    """The script's tokens in turn, then EOS; tokens forced on the sampler (a reasoning
    budget's close) come first, and the script resumes after them."""

    def __init__(self, script: list[int], eos: int, *args):
        super().__init__(*args)
        self.script, self.eos = list(script), eos

    def __call__(self, logits: mx.array, logprobs: mx.array | None = None) -> mx.array:
        if self.forcing:
            return super().__call__(logits, logprobs)
        return mx.array([self.script.pop(0) if self.script else self.eos], dtype=mx.uint32)


class Family:
    """One family's engine, and the reply its model writes: reasoning holding tool-call
    markup, then a call of its own."""

    def __init__(self, name: str, engine: Engine):
        self.name, self.engine = name, engine
        tokenizer = engine.model.tokenizer
        self.harmony = Harmony.of(tokenizer) is not None
        self.syntax = tool_syntax(tokenizer)
        plan = engine.plan(
            PromptInput(messages=conversation_from_dicts(QUESTION), tools=tuple(TOOLS))
        )
        opening = "" if plan.opens_reasoning else tokenizer.think_start
        if self.harmony:
            opening = "<|channel|>analysis<|message|>"
        # Reasoning that goes on past a budget of two tokens, whose close is forced.
        self.long_reasoning = f"{opening}one two three four five"
        if self.harmony:
            self.reasoning = "I could call to=functions.read_file on b.py."
            self.script = (
                f"<|channel|>analysis<|message|>{self.reasoning}<|end|>"
                # A message to a function on the analysis channel is reasoning too.
                "<|start|>assistant<|channel|>analysis to=functions.read_file"
                '<|message|>{"path": "b.py"}<|end|>'
                f"<|start|>assistant<|channel|>commentary<|message|>{ANSWER}<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json"
                '<|message|>{"path": "a.py"}<|call|>never sent'
            )
            self.reasoning += '{"path": "b.py"}'
            return
        # Written as the templates write a turn: the start marker and a newline (Gemma 4's
        # `<|channel>thought` label ends there), the reasoning, the template's own close
        # (prompt/reply/reasoning.py reads it from the template: `\n<channel|>` for Gemma 4).
        opening += "\n" if opening else ""
        close = engine.planner.reasoning.close_text
        self.reasoning = f"Maybe {self._markup('b.py')} first."
        tail = self._markup("a.py") if self.syntax is not None else ""
        self.script = f"{opening}{self.reasoning}{close}{ANSWER}{tail}"
        # What the reply writes inside the block is its reasoning, newlines included, but
        # for the edges the template writes itself around reasoning sent back (Gemma 4's,
        # Qwen3's `\n` after the start marker and before the end marker): the client's
        # copy renders back as the model wrote it.
        written = "\n" * opening.endswith("\n") + self.reasoning
        written += close[: close.index(tokenizer.think_end)]
        edges = plan.reasoning_edges
        self.reasoning = written.removeprefix(edges.lead).removesuffix(edges.trail)

    def _markup(self, path: str) -> str:
        """A call as this family's template writes one (so as its model does)."""
        if self.syntax is None:
            return (
                f'<tool_call>{{"name": "read_file", "arguments": {{"path": "{path}"}}}}</tool_call>'
            )
        turn = [
            *QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [call("c1", path)]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
        ]
        renderer = self.engine.planner.renderer
        text = renderer.render_text(
            conversation_from_dicts(turn), tools=TOOLS, add_generation_prompt=False
        )
        start = text.rindex(self.syntax.start)
        end = text.index(self.syntax.end, start) + len(self.syntax.end)
        return text[start:end]

    @property
    def calls(self) -> list[tuple[str, dict]]:
        """The calls the reply makes: only the one after the reasoning."""
        return [("read_file", {"path": "a.py"})] if self.syntax is not None else []


@pytest.fixture(scope="module", params=REASONING_FAMILIES)
def family(request):
    scripts: dict[int, list[int]] = {}

    def sampler(params, *args):
        if params.seed in scripts:
            return ScriptedSampler(
                scripts[params.seed], min(tokenizer.eos_token_ids), params, *args
            )
        return TokenSampler(params, *args)

    model = template_model(request.param)
    tokenizer = model.tokenizer
    with calibrated_once(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(arrival, "TokenSampler", sampler)
        engine = Engine(model, TEST_CACHE, EngineConfig(prefetch_next_turn=False))
        found = Family(request.param, engine)
        for seed, text in ((SEED, found.script), (BUDGET_SEED, found.long_reasoning)):
            scripts[seed] = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(scripts[seed]) == text
        # What the engine sends: up to the end of the script, or its `<|call|>` (a stop).
        sent = found.script.split("<|call|>")[0]
        found.reply_tokens = len(tokenizer.encode(sent, add_special_tokens=False))
        with serving(engine) as (url, _):
            found.url = url
            yield found


def clean(*texts: str) -> bool:
    return not any(t in text for t in CONTROL for text in texts)


def test_chat_reasoning_field_and_calls(family):
    with openai_client(family.url) as client:
        r = client.chat.completions.create(
            model="m", messages=QUESTION, tools=TOOLS, seed=SEED, max_tokens=300
        )
        message = r.choices[0].message
        assert message.model_extra["reasoning_content"] == family.reasoning
        assert message.content.strip() == ANSWER and clean(message.content)
        calls = [
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
        ]
        assert calls == family.calls
        expected = "tool_calls" if family.calls else "stop"
        assert r.choices[0].finish_reason == expected
        assert r.usage.completion_tokens == family.reply_tokens
        stream = client.chat.completions.create(
            model="m", messages=QUESTION, tools=TOOLS, seed=SEED, max_tokens=300, stream=True
        )
        deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas)
    assert streamed == family.reasoning
    assert "".join(d.content or "" for d in deltas).strip() == ANSWER
    assert sum(len(d.tool_calls or []) for d in deltas) == len(family.calls)


def test_messages_thinking_block_and_tool_use(family):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    ask = dict(model="m", max_tokens=300, messages=QUESTION, tools=tools)
    with anthropic_client(family.url) as client:
        whole = client.messages.create(**ask, extra_body={"seed": SEED})
        with client.messages.stream(**ask, extra_body={"seed": SEED}) as stream:
            streamed = stream.get_final_message()
    for m in (whole, streamed):
        kinds = ["thinking", "text"] + ["tool_use"] * len(family.calls)
        assert [b.type for b in m.content] == kinds
        assert m.content[0].thinking == family.reasoning
        assert m.content[1].text.strip() == ANSWER
        assert [(b.name, b.input) for b in m.content[2:]] == family.calls


def test_responses_reasoning_item_and_function_call(family):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    ask = dict(model="m", input=QUESTION, tools=tools, max_output_tokens=300)
    with openai_client(family.url) as client:
        whole = client.responses.create(**ask, extra_body={"seed": SEED})
        events = list(client.responses.create(**ask, stream=True, extra_body={"seed": SEED}))
    streamed = next(e.response for e in events if e.type == "response.completed")
    for r in (whole, streamed):
        kinds = ["reasoning", "message"] + ["function_call"] * len(family.calls)
        assert [item.type for item in r.output] == kinds
        assert r.output[0].content[0].text == family.reasoning
        assert r.output[1].content[0].text.strip() == ANSWER
        assert [(i.name, json.loads(i.arguments)) for i in r.output[2:]] == family.calls


def test_a_spent_budget_closes_the_reasoning_and_the_model_answers(family):
    with openai_client(family.url) as client:
        r = client.chat.completions.create(
            model="m",
            messages=QUESTION,
            seed=BUDGET_SEED,
            max_tokens=40,
            extra_body={"thinking_token_budget": 2},
        )
    message = r.choices[0].message
    # The template's close after two reasoning tokens; the script goes on as the answer.
    assert message.model_extra["reasoning_content"].strip() == "one two"
    assert message.content.strip() == "three four five" and clean(message.content)


# Families whose template renders reasoning sent back, on a turn that made a call, as
# their model writes it (Kimi K2's drops it: the next turn reuses up to the reply's start).
ROUND_TRIP = ("Qwen3.5", "Qwen3", "Nemotron 3 Nano", "GLM-4.7", "MiniMax M2", "Gemma 4")
# Gemma 4 writes its thought channel once the template's `<|think|>` turns thinking on
# (thinking off, its generation prompt holds an empty channel its history never does).
THINKING = {"Gemma 4": {"enable_thinking": True}}


def test_the_reply_sent_back_renders_as_written_through_its_reasoning(family):
    """Issue 34, item 2: the reply as the client sends it back (its reasoning, text and
    calls as the server answered them), and as the next-turn prefetch renders it,
    renders the prompt and the reply's own tokens through the end of its reasoning, so
    the agent's next turn reuses the cache past the reasoning. Before, Gemma 4's template
    wrote `<|channel>thought\\n` before the `\\n` the reasoning came back with, and
    Nemotron's and MiniMax's `\\n</think>` after the `\\n` it ended with."""
    if family.syntax is None:
        pytest.skip("no tool calls: the reply comes back as text")
    if family.harmony:  # its analysis message comes back as written (test_prompt_harmony)
        pytest.skip("gpt-oss's template takes no reasoning beside a preamble and calls")
    engine, tokenizer = family.engine, family.engine.model.tokenizer
    kwargs = THINKING.get(family.name)
    with openai_client(family.url) as client:
        r = client.chat.completions.create(
            model="m",
            messages=QUESTION,
            tools=TOOLS,
            seed=SEED,
            max_tokens=300,
            extra_body={"chat_template_kwargs": kwargs} if kwargs else None,
        )
    message = r.choices[0].message
    source = PromptInput(
        messages=conversation_from_dicts(QUESTION), tools=tuple(TOOLS), chat_template_kwargs=kwargs
    )
    plan = engine.plan(source)
    sent = family.script.split("<|call|>")[0]
    generated = [*plan.tokens, *tokenizer.encode(sent, add_special_tokens=False)]
    end = engine.planner.reasoning.end_text
    through = sent[: sent.index(end) + len(end)]  # an end marker: a token of its own
    reach = len(plan.tokens) + len(tokenizer.encode(through, add_special_tokens=False))

    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls]  # fmt: skip
    back = {"role": "assistant", "content": message.content, "tool_calls": calls}
    back["reasoning_content"] = message.model_extra["reasoning_content"]
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "x"}
    turn = replace(source, messages=conversation_from_dicts([*QUESTION, back, result]))
    sent_back = common_prefix_length(engine.plan(turn).tokens, generated)
    prefetched = next_turn_prompt(
        engine.planner, source, sent, len(plan.tokens), family.syntax, r.id, plan.opens_reasoning
    )
    assert prefetched is not None
    predicted = common_prefix_length(prefetched.tokens, generated)
    # The prefetch renders the turn the client sends, up to where its last message begins.
    assert predicted == min(sent_back, len(prefetched.tokens))
    if family.name in ROUND_TRIP:
        assert min(sent_back, predicted) >= reach
    else:
        assert sent_back == len(plan.tokens)
