"""Client cache breakpoints (`cache_control`) become BREAKPOINT checkpoints on the grid,
and a hybrid model restores exactly there when what follows them changes."""

from __future__ import annotations

import pytest
from support.engine_helpers import run, warm_equals_cold
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import CacheConfig
from mlx_prefix.conversation import Message
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.records import Breakpoint, PromptInput

BREAKPOINT = CheckpointKind.BREAKPOINT
STABLE = "You are a careful assistant for a public library. " * 12
RULES = "Today's notice: the reading room closes early. "
TOOLS = tuple(
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Look up {name} in the catalogue.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    for name in ("books", "maps", "films")
)


def planner(chunk: int = 32, think: bool = True) -> PromptPlanner:
    model = loaded_test_model("dense", think_template=think)
    return PromptPlanner(
        model.tokenizer, CacheConfig(prefill_chunk=chunk, checkpoint_interval=4096)
    )


def prompt(*breakpoints: Breakpoint, rules: str = RULES, **extra) -> PromptInput:
    return PromptInput(
        messages=(
            Message("system", STABLE + rules),
            Message("user", "Do you lend maps?"),
            Message("assistant", "Yes, for a week."),
            Message("user", "And atlases?"),
        ),
        breakpoints=breakpoints,
        **extra,
    )


def marked(p: PromptPlanner, source: PromptInput) -> list[int]:
    return [c.position for c in p.plan(source).checkpoints if c.kind is BREAKPOINT]


def test_a_breakpoint_inside_the_system_prompt_lands_on_the_grid_just_before_it():
    p = planner()
    rendered = p.plan(prompt(Breakpoint(message=0, chars=len(STABLE))))
    (position,) = marked(p, prompt(Breakpoint(message=0, chars=len(STABLE))))
    text = p.renderer.tokenizer.decode(list(rendered.tokens[:position]))
    stable_end = text.find(STABLE) + len(STABLE)
    assert 0 < stable_end and position == p.grid.align(rendered.tokens, position)
    assert len(p.renderer.tokenizer.decode(list(rendered.tokens[position:]))) > len(RULES)
    # At most one chunk before the breakpoint: what follows it may change freely.
    other = p.plan(prompt(Breakpoint(message=0, chars=len(STABLE)), rules="Another notice."))
    assert other.tokens[:position] == rendered.tokens[:position]
    assert marked(p, prompt(Breakpoint(message=0, chars=len(STABLE)), rules="Other.")) == [position]
    exact = p.renderer.encode_chat(p.renderer.render_text(list(prompt().messages)))
    stable_tokens = next(
        i for i in range(len(exact)) if STABLE in p.renderer.tokenizer.decode(exact[:i])
    )
    assert stable_tokens - p.grid.chunk_size < position <= stable_tokens


def test_a_breakpoint_at_a_message_end_cuts_after_the_next_message_start():
    p = planner()
    source = prompt(Breakpoint(message=1))
    rendered = p.plan(source)
    (position,) = marked(p, source)
    before = p.renderer.tokenizer.decode(list(rendered.tokens[:position]))
    assert "Do you lend maps?<|im_end|>\n<|im_start|>" in before  # the message, and its end
    assert "Yes, for a week." not in before  # but not the next message


def test_the_last_message_breakpoint_upgrades_the_history_checkpoint_and_system_wins():
    p = planner()
    plain = {c.position: c.kind for c in p.plan(prompt()).checkpoints}
    source = prompt(Breakpoint(message=3), Breakpoint(message=0))
    kinds = {c.position: c.kind for c in p.plan(source).checkpoints}
    history = max(pos for pos, k in plain.items() if k is CheckpointKind.HISTORY)
    assert kinds[history] is BREAKPOINT  # the prompt's end, after the generation prompt
    system = next(pos for pos, k in plain.items() if k is CheckpointKind.SYSTEM)
    assert kinds[system] is CheckpointKind.SYSTEM  # a breakpoint never lowers a kind
    assert set(kinds) == set(plain)


def test_a_tool_breakpoint_lands_where_the_next_tool_begins():
    p = planner()
    source = prompt(Breakpoint(tool=0), tools=TOOLS)
    rendered = p.plan(source)
    (position,) = marked(p, source)
    text = p.renderer.tokenizer.decode(list(rendered.tokens[:position]))
    assert '"books"' in text and '"maps"' not in text
    full = p.renderer.tokenizer.decode(list(rendered.tokens))
    assert full.index('"maps"') - len(text) < 4 * p.grid.chunk_size  # within a chunk's tokens


def test_an_assistant_prefix_is_rendered_after_the_generation_prompt():
    p = planner()
    rendered = p.plan(prompt(assistant_prefix="<tool_call>"))
    text = p.renderer.tokenizer.decode(list(rendered.tokens))
    assert text.endswith("<|im_start|>assistant\n<tool_call>")
    assert p.prompt_tokens(prompt(assistant_prefix="<tool_call>")) == list(rendered.tokens)


@pytest.mark.parametrize("kind", ["qwen3_5", "dense"])
def test_a_hybrid_restores_at_the_breakpoint_when_what_follows_changes(make_engine, kind):
    engine = make_engine(kind, think_template=True)
    mark = Breakpoint(message=0, chars=len(STABLE))
    first = run(engine, prompt(mark))
    assert first.usage.cache_written_tokens > 0
    (position,) = marked(engine.planner, prompt(mark))
    stored = [(e["tokens"], e["kind"]) for e in engine.views.cache_entries()]
    if kind == "qwen3_5":
        assert (position, BREAKPOINT) in stored
    else:  # an all-KV cache: the system prompt's entry (kept longer) serves it by trimming
        assert any(n > position and k >= BREAKPOINT for n, k in stored)
    changed = prompt(mark, rules="A different notice, longer than the first one was.")
    warm = warm_equals_cold(engine, changed)
    assert warm.usage.cached_tokens == position  # restored exactly at the breakpoint
    # Without the client's breakpoint a hybrid finds no exact checkpoint that late.
    if kind == "qwen3_5":
        unmarked = make_engine(kind, think_template=True, cache_config=TEST_CACHE)
        run(unmarked, prompt())
        assert run(unmarked, prompt(rules="Another notice.")).usage.cached_tokens < position
