"""Random-weight models carrying a real tokenizer (Qwen3's, vendored under
tests/data/tokenizers) and served with the real chat templates of the model families
people run (tests/data/templates, from llama.cpp), and an agent's conversation to put
through them. Nothing here touches the network."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_prefix.models.load import LoadedModel, load_model
from mlx_prefix.models.testing import cached_test_model

DATA = Path(__file__).parent / "data"
QWEN3_TOKENIZER = DATA / "tokenizers" / "qwen3"

# family -> its template file under tests/data/templates
TEMPLATES: dict[str, str] = {
    "Qwen3.5": "Qwen3.5-4B.jinja",
    "Qwen3-Coder": "Qwen3-Coder.jinja",
    "Qwen3": "Qwen-Qwen3-0.6B.jinja",
    "Nemotron 3 Nano": "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
    "Granite 4.0": "ibm-granite-granite-4.0.jinja",
    "LFM2.5": "LFM2.5-Instruct.jinja",
    "gpt-oss": "openai-gpt-oss-120b.jinja",
    "GLM-4.7": "GLM-4.7-Flash.jinja",
    "DeepSeek V3.1": "deepseek-ai-DeepSeek-V3.1.jinja",
    "Gemma 4": "google-gemma-4-31B-it.jinja",
    "Kimi K2": "moonshotai-Kimi-K2.jinja",
    "MiniMax M2": "MiniMax-M2.jinja",
    "Llama 3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "Mistral Small 3.2": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
}
# Templates that render an earlier assistant turn differently once the conversation
# grows (they drop its reasoning, or render it only while no user message follows).
RERENDERING = ("GLM-4.7", "DeepSeek V3.1", "MiniMax M2")

_loaded: dict[tuple[str, str], LoadedModel] = {}


def template_model(family: str, kind: str = "dense") -> LoadedModel:
    """A tiny `kind` model with Qwen3's tokenizer, served with `family`'s template
    (loaded once per process; the weights folder is shared by every template)."""
    key = (family, kind)
    if key not in _loaded:
        folder = cached_test_model(kind, tokenizer=QWEN3_TOKENIZER)
        template = DATA / "templates" / TEMPLATES[family]
        _loaded[key] = load_model(str(folder), chat_template=str(template))
    return _loaded[key]


# -- an agent's conversation, in chat completions' shape -----------------------------------

SYSTEM = "You are a careful coding agent. Read files before you answer. " * 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def call(call_id: str, path: str) -> dict:
    arguments = json.dumps({"path": path})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "read_file", "arguments": arguments},
    }


# The client's ids, as the OpenAI SDK and Claude Code write them: no template's own form.
FIRST_ID, SECOND_ID = "call_Xq3L0vA9eR2mT7", "toolu_01HnU4d2kPq8"

# Each turn: the messages the client sends (after the system prompt).
AGENT_TURNS: tuple[tuple[dict, ...], ...] = (
    ({"role": "user", "content": "What does main.py print?"},),
    (
        {"role": "user", "content": "What does main.py print?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should read main.py first.",
            "tool_calls": [call(FIRST_ID, "main.py")],
        },
        {"role": "tool", "tool_call_id": FIRST_ID, "content": "print('hello')"},
    ),
    (
        {"role": "user", "content": "What does main.py print?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should read main.py first.",
            "tool_calls": [call(FIRST_ID, "main.py")],
        },
        {"role": "tool", "tool_call_id": FIRST_ID, "content": "print('hello')"},
        {"role": "assistant", "content": "It prints hello."},
        {"role": "user", "content": "And util.py?"},
    ),
    (
        {"role": "user", "content": "What does main.py print?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should read main.py first.",
            "tool_calls": [call(FIRST_ID, "main.py")],
        },
        {"role": "tool", "tool_call_id": FIRST_ID, "content": "print('hello')"},
        {"role": "assistant", "content": "It prints hello."},
        {"role": "user", "content": "And util.py?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Now util.py.",
            "tool_calls": [call(SECOND_ID, "util.py")],
        },
        {"role": "tool", "tool_call_id": SECOND_ID, "content": "def helper():\n    return 42"},
    ),
)


def chat_messages(turn: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *AGENT_TURNS[turn]]
