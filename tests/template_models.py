"""Random-weight models carrying a real tokenizer (Qwen3's, and gpt-oss's own for
gpt-oss, whose harmony control tokens are single tokens; vendored under
tests/data/tokenizers) and served with the real chat templates of the model families
people run (tests/data/templates, from llama.cpp), and an agent's conversation to put
through them. Nothing here touches the network."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from mlx_prefix.engine import loop
from mlx_prefix.engine.calibration import Calibration
from mlx_prefix.models.identity import chat_template_hash
from mlx_prefix.models.load import LoadedModel, load_model
from mlx_prefix.models.testing import cached_test_model

DATA = Path(__file__).parent / "data"
QWEN3_TOKENIZER = DATA / "tokenizers" / "qwen3"
GPT_OSS_TOKENIZER = DATA / "tokenizers" / "gpt-oss"

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
# Families whose template opens reasoning in the generation prompt or whose models write
# it (Kimi K2 Thinking writes `<think>` under K2's chat format). Gemma 4's reasoning
# (`<|channel>thought`) needs its own tokenizer's tokens, which Qwen3's lacks.
REASONING_FAMILIES = (
    "Qwen3.5",
    "Qwen3",
    "Nemotron 3 Nano",
    "GLM-4.7",
    "DeepSeek V3.1",
    "MiniMax M2",
    "Kimi K2",
    "LFM2.5",
    "gpt-oss",
)
# family -> its tokenizer, where Qwen3's cannot stand in for it
TOKENIZERS = {"gpt-oss": GPT_OSS_TOKENIZER}

_weights: dict[tuple[str, Path], LoadedModel] = {}
_loaded: dict[tuple[str, str], LoadedModel] = {}
_calibrations: dict[int, Calibration] = {}  # by the model object's id (kept alive above)


def template_model(family: str, kind: str = "dense") -> LoadedModel:
    """A tiny `kind` model with Qwen3's tokenizer (or the family's own, TOKENIZERS),
    served with `family`'s template. Loaded once per process; the templates of one
    tokenizer share one model object (its weights and the engine's calibration of
    them), each with its own tokenizer wrapper (mlx-lm picks the tool parser from the
    template) and cache identity."""
    key = (family, kind)
    if key not in _loaded:
        source = TOKENIZERS.get(family, QWEN3_TOKENIZER)
        if (kind, source) not in _weights:
            folder = cached_test_model(kind, tokenizer=source)
            _weights[kind, source] = load_model(str(folder))
        base = _weights[kind, source]
        template = (DATA / "templates" / TEMPLATES[family]).read_text(encoding="utf-8")
        config = json.loads((base.path / "config.json").read_text())
        tokenizer = load_tokenizer(
            base.path, {"chat_template": template}, eos_token_ids=config.get("eos_token_id")
        )
        identity = replace(base.identity, chat_template_hash=chat_template_hash(template))
        _loaded[key] = replace(base, tokenizer=tokenizer, identity=identity)
    return _loaded[key]


@contextmanager
def calibrated_once() -> Iterator[None]:
    """Engines of one shared model object calibrate it once (engine/calibration.py
    measures the model's layers; the templates change nothing it measures)."""
    original = loop.calibrate

    def once(model: LoadedModel) -> Calibration:
        if id(model.model) not in _calibrations:
            _calibrations[id(model.model)] = original(model)
        return _calibrations[id(model.model)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "calibrate", once)
        yield


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

# The whole agent conversation the client builds (after the system prompt).
_CONVERSATION: tuple[dict, ...] = (
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
)
# Each turn: the messages the client sends, a longer prefix of the conversation each time
# (a question; its call's result; the answer and a new question; the second call's result).
AGENT_TURNS: tuple[tuple[dict, ...], ...] = tuple(_CONVERSATION[:n] for n in (1, 3, 5, 7))


def chat_messages(turn: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *AGENT_TURNS[turn]]
