"""The real engine behind /v1/messages, driven by the official anthropic SDK: an agent's
tool loop reads its prefix from the cache, and a warm answer equals its cold run."""

from __future__ import annotations

import time

from support.live import anthropic_client, live_server
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import serving

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import DiskConfig
from mlx_prefix.engine.engine import Engine

BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=sdk-cli; cch={};"
AGENT = "You are a coding agent working in a small repository. Read files before editing. " * 6
TOOLS = [
    {
        "name": name,
        "description": f"{name} a file in the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name in ("Read", "Edit", "Grep")
]
EPHEMERAL = {"type": "ephemeral"}


def system(request_number: int) -> list[dict]:
    """Claude Code's shape: a billing header that changes per request, then the prompt."""
    return [
        {"type": "text", "text": BILLING.format(request_number, f"{request_number:05x}")},
        {"type": "text", "text": AGENT, "cache_control": EPHEMERAL},
    ]


live = live_server(
    lambda kind: Engine(loaded_test_model(kind, think_template=True), TEST_CACHE),
    params=["qwen3_5", "dense"],
)


def ask(client, messages, n: int, cache: bool = True):
    # The SDK (2.x) has no sampling arguments any more; greedy goes in the body.
    body = {"temperature": 0} if cache else {"temperature": 0, "prefix_cache": {"enabled": False}}
    return client.messages.create(
        model="claude-local",
        max_tokens=6,
        system=system(n),
        tools=TOOLS,
        messages=messages,
        extra_body=body,
    )


def test_tool_loop_turns_read_their_prefix_and_warm_equals_cold(claude, engine):
    turns = [{"role": "user", "content": [{"type": "text", "text": "Fix the typo in main.py"}]}]
    first = ask(claude, turns, 1)
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens > 0
    turns += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it first."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "Read",
                    "input": {"path": "main.py"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01",
                    "content": "print('helo world')",
                    "cache_control": EPHEMERAL,
                }
            ],
        },
    ]
    warm = ask(claude, turns, 2)
    total = warm.usage.input_tokens + warm.usage.cache_read_input_tokens
    total += warm.usage.cache_creation_input_tokens
    assert (
        total
        == claude.messages.count_tokens(
            model="m", system=system(2), tools=TOOLS, messages=turns
        ).input_tokens
    )
    # The billing header changed and was left out: the system prompt and tools, and the
    # first user message, come from the cache.
    assert warm.usage.cache_read_input_tokens > first.usage.cache_creation_input_tokens // 2
    cold = ask(claude, turns, 3, cache=False)
    assert cold.usage.cache_read_input_tokens == 0
    assert [b.model_dump() for b in warm.content] == [b.model_dump() for b in cold.content]
    with claude.messages.stream(
        model="m",
        max_tokens=6,
        system=system(4),
        tools=TOOLS,
        messages=turns,
        extra_body={"temperature": 0},
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in cold.content]
    assert streamed.usage.cache_read_input_tokens >= warm.usage.cache_read_input_tokens
    kinds = {e["kind"] for e in engine.views.cache_entries()}
    assert CheckpointKind.BREAKPOINT in kinds
    engine.store.check_integrity()


def test_breakpoints_reach_the_disk_at_first_sight(tmp_path):
    disk = DiskConfig(scope="auto", directory=str(tmp_path), min_tokens=16)
    engine = Engine(loaded_test_model("qwen3_5", think_template=True), TEST_CACHE, disk_config=disk)
    with serving(engine) as (url, _):
        with anthropic_client(url) as client:
            ask(client, [{"role": "user", "content": "hello"}], 1)
        deadline = time.monotonic() + 60  # saves are written once the engine is idle
        while (engine.disk.pending or not engine.disk.cache.entries()) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        kinds = {e.kind for e in engine.disk.cache.entries()}
    # One request: nothing is shared with an earlier one yet, so `auto` saves only what
    # the client marked: the end of its system prompt (a SYSTEM checkpoint, marked).
    assert kinds == {"SYSTEM"}
