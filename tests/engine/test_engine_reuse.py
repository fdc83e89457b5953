"""A cache hit never changes the answer (issue 4), on every kind of cache.

Each scenario serves requests with the prefix cache and again with it disabled (an
empty-cache cold run on the same engine thread); greedy outputs must be identical and
the reused token counts must reach what the checkpoint policy promises.
"""

from __future__ import annotations

import pytest
from support.engine_helpers import chat, run, warm_equals_cold

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.records import PromptInput

KINDS = ["dense", "qwen3_5", "nemotron_h", "sliding"]

SYSTEM = (
    "You are a careful assistant for a small bookshop. Answer questions about opening hours, "
    "stock, orders and returns. Be brief, polite and precise; never invent titles that are not "
    "in the catalogue, and say so when you do not know."
)


def checkpoint_position(engine, prompt: PromptInput, kind: CheckpointKind) -> int:
    return max(c.position for c in engine.plan(prompt).checkpoints if c.kind == kind)


@pytest.mark.parametrize("kind", KINDS)
def test_multi_turn_reuses_the_whole_previous_prompt(make_engine, kind):
    engine = make_engine(kind)
    suffix = len(engine.planner.grid.generation_suffix)
    messages = [("system", SYSTEM)]
    expected_reuse = 0
    for turn in range(5):
        messages.append(("user", f"Question {turn}: do you have book number {turn * 7}?"))
        prompt = chat(*messages)
        result = warm_equals_cold(engine, prompt)
        assert result.usage.cached_tokens >= expected_reuse
        # The next turn shares this whole prompt, unless the reply starts with whitespace
        # that BPE merges with the generation prompt's "\n": then it shares up to the
        # cut just after the generation prompt's special token.
        reply = result.text
        merges = reply[:1].isspace()
        expected_reuse = result.usage.prompt_tokens - (suffix - 1 if merges else 0)
        messages.append(("assistant", reply))
    engine.store.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_divergent_users_reuse_the_whole_system_prompt(make_engine, kind):
    engine = make_engine(kind)
    run(engine, chat(("system", SYSTEM), ("user", "When do you open on Sundays?")))
    second = chat(("system", SYSTEM), ("user", "Can I return a book without a receipt?"))
    result = warm_equals_cold(engine, second)
    system_end = checkpoint_position(engine, second, CheckpointKind.SYSTEM)
    assert result.usage.cached_tokens >= system_end > len(engine.plan(second).tokens) // 3


@pytest.mark.parametrize("kind", KINDS)
def test_regenerating_the_last_message_reuses_up_to_the_generation_prompt(make_engine, kind):
    engine = make_engine(kind)
    prompt = chat(("system", SYSTEM), ("user", "Do you sell maps?"))
    first = run(engine, prompt)
    again = warm_equals_cold(engine, prompt)
    assert again.tokens == first.tokens
    suffix = len(engine.planner.grid.generation_suffix)
    assert again.usage.cached_tokens >= again.usage.prompt_tokens - suffix + 1


@pytest.mark.parametrize("kind", KINDS)
def test_edited_earlier_message_falls_back_to_the_system_prompt(make_engine, kind):
    engine = make_engine(kind)
    history = [
        ("system", SYSTEM),
        ("user", "I ordered a cookbook last week."),
        ("assistant", "Thank you, I can see the order."),
        ("user", "When will it arrive?"),
    ]
    run(engine, chat(*history))
    edited = [history[0], ("user", "I ordered a novel last month."), *history[2:]]
    prompt = chat(*edited)
    result = warm_equals_cold(engine, prompt)
    assert result.usage.cached_tokens >= checkpoint_position(engine, prompt, CheckpointKind.SYSTEM)


@pytest.mark.parametrize("kind", KINDS)
def test_long_document_diverging_in_the_middle_reuses_up_to_a_periodic_checkpoint(
    make_engine, kind
):
    engine = make_engine(kind)
    words = [f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(40)]
    original = " ".join(words)
    edited = " ".join(words[:20] + ["an edited sentence that changes the middle."] + words[21:])
    run(engine, PromptInput(text=original))
    tokens_a = engine.plan(PromptInput(text=original)).tokens
    tokens_b = engine.plan(PromptInput(text=edited)).tokens
    diverge = next(i for i, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=True)) if a != b)
    interval = engine.cache_config.checkpoint_interval
    assert diverge > 2 * interval
    result = warm_equals_cold(engine, PromptInput(text=edited))
    assert result.usage.cached_tokens >= (diverge // interval) * interval


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_thinking_template_next_turn_reuses_up_to_the_previous_reply(make_engine, kind):
    engine = make_engine(kind, think_template=True)
    messages = [("system", SYSTEM), ("user", "Is the shop open today?")]
    first = warm_equals_cold(engine, chat(*messages))
    reply = "<think>\nThe user asks about today. It is Monday.\n</think>\n\nYes, until six."
    messages += [("assistant", reply), ("user", "And tomorrow?")]
    second = warm_equals_cold(engine, chat(*messages))
    assert "<think>" not in engine.planner.renderer.tokenizer.decode(
        list(engine.plan(chat(*messages)).tokens)
    )
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    engine.store.check_integrity()
