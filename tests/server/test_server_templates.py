"""The real chat templates of 14 model families, served with Qwen3's real tokenizer (and
gpt-oss with its own, Gemma 4 with its control tokens) on a tiny random-weight model,
over chat completions, Anthropic Messages and Responses: an agent's conversation (system
prompt, tools, a call with reasoning, its result, an answer, a new question, another
call) renders and answers 200 (or a 400 naming the template's own refusal, never a 5xx),
and every turn reuses what it shares with the turn before, up to the grid point at the
divergence."""

from __future__ import annotations

import json

import httpx
import pytest
from support.models import TEST_CACHE
from support.server_fakes import serving
from support.template_models import (
    AGENT_TURNS,
    SYSTEM,
    TEMPLATES,
    TOOLS,
    calibrated_once,
    chat_messages,
    template_model,
)

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.prompt.request.plan import RenderedPrompt
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import PromptInput

TURNS = len(AGENT_TURNS)


class RecordingEngine(Engine):
    """The engine, keeping every request's rendered prompt."""

    def plan(self, prompt: PromptInput) -> RenderedPrompt:
        rendered = super().plan(prompt)
        self.plans.append(rendered)
        return rendered


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request):
    with calibrated_once():
        engine = RecordingEngine(
            template_model(request.param), TEST_CACHE, EngineConfig(prefetch_next_turn=False)
        )
        engine.plans, engine.family = [], request.param
        with serving(engine) as (url, _), httpx.Client(base_url=url, timeout=120) as client:
            yield client, engine


# family -> the refusal its template raises for this conversation (a 400 naming it).
# None today: Mistral's "Tool call IDs should be alphanumeric strings with length 9!"
# is met by mapping the ids (prompt/request/call_ids.py).
REFUSALS: dict[str, str] = {}


def post(client: httpx.Client, path: str, body: dict, family: str) -> dict | None:
    """The answer's JSON, or None for the template's own refusal (a 400 saying so)."""
    response = client.post(path, json=body)
    if family in REFUSALS and response.status_code == 400:
        assert REFUSALS[family] in response.json()["error"]["message"]
        return None
    assert response.status_code == 200, response.text
    return response.json()


def converse(client, engine, path: str, bodies: list[dict], cached_of) -> None:
    engine.views.flush_cache()
    previous = None
    for turn, body in enumerate(bodies):
        answer = post(client, path, body, engine.family)
        if answer is None:
            previous = None
            continue
        tokens = engine.plans[-1].tokens
        if previous is not None:
            shared = common_prefix_length(previous, tokens)
            expected = engine.planner.grid.align(tokens, min(shared, len(tokens) - 1))
            assert cached_of(answer) >= expected > 0, (turn, shared, len(previous))
        previous = tokens


def test_chat_completions(served):
    client, engine = served
    bodies = [
        {
            "model": "m",
            "messages": chat_messages(turn),
            "tools": TOOLS,
            "max_tokens": 3,
            "temperature": 0,
        }
        for turn in range(TURNS)
    ]
    converse(
        client,
        engine,
        "/v1/chat/completions",
        bodies,
        lambda a: a["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def _anthropic_messages(turn: int) -> list[dict]:
    out: list[dict] = []
    for m in AGENT_TURNS[turn]:
        if m["role"] == "user":
            out.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
        elif m["role"] == "tool":
            result = {
                "type": "tool_result",
                "tool_use_id": m["tool_call_id"],
                "content": m["content"],
            }
            out.append({"role": "user", "content": [result]})
        else:
            blocks: list[dict] = []
            if m.get("reasoning_content"):
                blocks.append(
                    {"type": "thinking", "thinking": m["reasoning_content"], "signature": ""}
                )
            if m["content"]:
                blocks.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls", ()):
                f = c["function"]
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": c["id"],
                        "name": f["name"],
                        "input": json.loads(f["arguments"]),
                    }
                )
            out.append({"role": "assistant", "content": blocks})
    return out


def test_anthropic_messages(served):
    client, engine = served
    tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in TOOLS
    ]  # fmt: skip
    bodies = [
        {
            "model": "m",
            "system": SYSTEM,
            "messages": _anthropic_messages(turn),
            "tools": tools,
            "max_tokens": 3,
            "temperature": 0,
        }
        for turn in range(TURNS)
    ]
    converse(
        client, engine, "/v1/messages", bodies, lambda a: a["usage"]["cache_read_input_tokens"]
    )


def _response_items(turn: int) -> list[dict]:
    out: list[dict] = []
    for m in AGENT_TURNS[turn]:
        if m["role"] == "user":
            out.append({"type": "message", "role": "user", "content": m["content"]})
        elif m["role"] == "tool":
            out.append(
                {
                    "type": "function_call_output",
                    "call_id": m["tool_call_id"],
                    "output": m["content"],
                }
            )
        else:
            if m["content"]:
                text = {"type": "output_text", "text": m["content"]}
                out.append({"type": "message", "role": "assistant", "content": [text]})
            for c in m.get("tool_calls", ()):
                f = c["function"]
                out.append(
                    {"type": "function_call", "call_id": c["id"], "name": f["name"],
                     "arguments": f["arguments"]}
                )  # fmt: skip
    return out


def test_responses(served):
    client, engine = served
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    bodies = [
        {
            "model": "m",
            "instructions": SYSTEM,
            "input": _response_items(turn),
            "tools": tools,
            "max_output_tokens": 3,
            "temperature": 0,
            "store": False,
        }
        for turn in range(TURNS)
    ]
    converse(
        client,
        engine,
        "/v1/responses",
        bodies,
        lambda a: a["usage"]["input_tokens_details"]["cached_tokens"],
    )
