"""Random-weight models carrying a real tokenizer (Qwen3's, and gpt-oss's own for
gpt-oss, whose harmony control tokens are single tokens; vendored under
tests/data/tokenizers; for Gemma 4, whose tokenizer no public package ships, Qwen3's
vocabulary with Gemma 4's control tokens) and served with the real chat templates of the
model families people run (tests/data/templates, from llama.cpp), and an agent's
conversation to put through them. Nothing here touches the network."""

from __future__ import annotations

import atexit
import gzip
import json
import shutil
import tempfile
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
from mlx_prefix.models.stops import add_reply_stops
from mlx_prefix.models.testing import THINK_CHAT_TEMPLATE, cached_test_model
from support.paths import DATA

QWEN3_TOKENIZER = DATA / "tokenizers" / "qwen3"
GPT_OSS_TOKENIZER = DATA / "tokenizers" / "gpt-oss"
# Only a tokenizer_config.json: Gemma 4's control tokens, put on Qwen3's vocabulary.
GEMMA4_CONTROLS = DATA / "tokenizers" / "gemma4-controls-on-qwen3"

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
# it (Kimi K2 Thinking writes `<think>` under K2's chat format, Gemma 4 its `thought`
# channel once the template's `<|think|>` turns thinking on).
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
    "Gemma 4",
)
# family -> its tokenizer, where Qwen3's cannot stand in for it
TOKENIZERS = {"gpt-oss": GPT_OSS_TOKENIZER, "Gemma 4": GEMMA4_CONTROLS}

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
        source = _tokenizer_files(TOKENIZERS.get(family, QWEN3_TOKENIZER))
        if (kind, source) not in _weights:
            folder = cached_test_model(kind, tokenizer=source)
            _weights[kind, source] = load_model(str(folder))
        base = _weights[kind, source]
        template = (DATA / "templates" / TEMPLATES[family]).read_text(encoding="utf-8")
        config = json.loads((base.path / "config.json").read_text())
        tokenizer = load_tokenizer(
            base.path, {"chat_template": template}, eos_token_ids=config.get("eos_token_id")
        )
        add_reply_stops(tokenizer)  # as models/load.py does for every model it loads
        identity = replace(base.identity, chat_template_hash=chat_template_hash(template))
        _loaded[key] = replace(base, tokenizer=tokenizer, identity=identity)
    return _loaded[key]


_built: dict[Path, Path] = {}


def _tokenizer_files(source: Path) -> Path:
    """`source`, or for a folder with only a tokenizer_config.json (GEMMA4_CONTROLS),
    a folder written once per process with Qwen3's BPE vocabulary and merges whose added
    tokens are that config's `added_tokens_decoder` instead of Qwen3's."""
    if (source / "tokenizer.json.gz").is_file() or source in _built:
        return _built.get(source, source)
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer = json.loads(gzip.decompress((QWEN3_TOKENIZER / "tokenizer.json.gz").read_bytes()))
    added = sorted((int(i), token) for i, token in config["added_tokens_decoder"].items())
    assert added[0][0] == len(tokenizer["model"]["vocab"]), "added tokens follow the vocabulary"
    tokenizer["added_tokens"] = [{"id": i, **token} for i, token in added]
    dest = Path(tempfile.mkdtemp(prefix="mlx-prefix-tokenizer-")) / source.name
    atexit.register(shutil.rmtree, dest.parent, ignore_errors=True)
    dest.mkdir()
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    shutil.copyfile(source / "tokenizer_config.json", dest / "tokenizer_config.json")
    _built[source] = dest
    return dest


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


# A template that prints tool-call ids (as Kimi's and Mistral's do): the prefetch must
# render the ids the server gave the client, or the next turn diverges at the first call.
ID_TEMPLATE = (
    THINK_CHAT_TEMPLATE.replace(
        "{%- if tool_call.function %}",
        "{%- set call_id = tool_call.id %}{%- if tool_call.function %}",
    )
    .replace(
        """'<tool_call>\\n{"name": "' + tool_call.name""",
        """'<tool_call>\\n{"id": "' + call_id + '", "name": "' + tool_call.name""",
    )
    .replace(
        "'\\n<tool_response>\\n' + content",
        "'\\n<tool_response id=\"' + message.tool_call_id + '\">\\n' + content",
    )
)
