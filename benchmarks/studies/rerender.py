"""Shared vs reused prompt tokens when a chat template re-renders earlier turns.

GLM-4.7, DeepSeek V3.1 and MiniMax M2 render an assistant turn differently once the
conversation grows (they drop or move its reasoning), so a request shares with the one
before only the tokens up to that turn's start. A scripted agent client (its replies are
its own, not the server's) sends six turns: a question, a call with reasoning, its result,
an answer, a new question, another call. Each request goes through the engine with the
default cache configuration on a tiny random-weight model (dense, or `--kind`) carrying Qwen3's real
tokenizer and the family's real template (tests/data), and each line reports the tokens it
shares with the previous prompt and the tokens the cache restored. No network.

`python -m mlx_prefix.blas_exec python -m benchmarks.studies.rerender [--json FILE]`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import CachePreference, DoneEvent, ErrorEvent, PromptInput, SamplingParams
from mlx_prefix.server.protocol.messages import conversation_from_dicts

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
FAMILIES = {
    "GLM-4.7": "GLM-4.7-Flash.jinja",
    "DeepSeek V3.1": "deepseek-ai-DeepSeek-V3.1.jinja",
    "MiniMax M2": "MiniMax-M2.jinja",
}
SYSTEM = "You are a coding agent. Read the files you need, then answer briefly. " * 30
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
)


def _call(call_id: str, path: str) -> dict:
    arguments = json.dumps({"path": path})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "read_file", "arguments": arguments},
    }


def conversation() -> list[list[dict]]:
    """Each turn's messages; every turn extends the one before."""
    turns, messages = [], [{"role": "system", "content": SYSTEM}]
    steps = [
        {"role": "user", "content": "What does main.py print?"},
        {"role": "assistant", "content": "", "reasoning_content": "Read main.py first.",
         "tool_calls": [_call("call_a1", "main.py")]},
        {"role": "tool", "tool_call_id": "call_a1", "content": "print('hello')\n" * 20},
        {"role": "assistant", "content": "It prints hello, twenty times.",
         "reasoning_content": "Twenty prints of hello."},
        {"role": "user", "content": "And util.py?"},
        {"role": "assistant", "content": "", "reasoning_content": "Now util.py.",
         "tool_calls": [_call("call_a2", "util.py")]},
        {"role": "tool", "tool_call_id": "call_a2", "content": "def helper():\n    return 42\n"},
    ]  # fmt: skip
    for step in steps:
        messages.append(step)
        if step["role"] != "assistant":  # the client asks after each of its own messages
            turns.append(list(messages))
    return turns


def run_family(family: str, folder: Path) -> list[dict]:
    model = load_model(str(folder), chat_template=str(DATA / "templates" / FAMILIES[family]))
    engine = Engine(model, CacheConfig(), EngineConfig(prefetch_next_turn=False))
    rows, previous = [], None
    try:
        for turn, messages in enumerate(conversation()):
            prompt = PromptInput(messages=conversation_from_dicts(messages), tools=TOOLS)
            tokens = engine.plan(prompt).tokens
            handle = engine.submit(prompt, SamplingParams(max_tokens=4), CachePreference())
            for event in handle.events(timeout=600):
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(event.message)
                if isinstance(event, DoneEvent):
                    usage = event.usage
            shared = common_prefix_length(previous, tokens) if previous is not None else 0
            rows.append(
                {"family": family, "turn": turn, "prompt": len(tokens), "shared": shared,
                 "reused": usage.cached_tokens}
            )  # fmt: skip
            previous = tokens
    finally:
        engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--kind", default="dense", help="test model kind (qwen3_5: a hybrid, exact states only)"
    )
    args = parser.parse_args()
    folder = cached_test_model(args.kind, tokenizer=DATA / "tokenizers" / "qwen3")
    rows = [row for family in FAMILIES for row in run_family(family, folder)]
    print(f"{'family':<14} {'turn':>4} {'prompt':>6} {'shared':>6} {'reused':>6}")
    for r in rows:
        print(
            f"{r['family']:<14} {r['turn']:>4} {r['prompt']:>6} {r['shared']:>6} {r['reused']:>6}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
