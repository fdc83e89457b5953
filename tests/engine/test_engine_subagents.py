"""Subagents beside a main agent (issue 55, item 4).

Claude Code's Task tool runs subagents beside the main agent, each on its own system
prompt; vllm-mlx's #541 reports a 28K main prefix evicted by 6-7K subagent prefixes.
The trace here is that shape at the test model's scale: a main agent whose
conversation is most of a budget sized from the measured KV of the main agent's
conversation and two subagents, five subagents of two turns each, then the main agent's
next turn. And five subagents that start together on one system prompt prefill it once.
"""

from __future__ import annotations

from support.engine_helpers import EXACT, GREEDY, chat, open_engine, run, submit_together
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import DoneEvent, TokenEvent

MAIN_SYSTEM = "You are the main agent. Plan the work and call tools. " * 100


def _subagent_system(k: int) -> str:
    return f"You are subagent {k}. " + f"Search the code for item {k} and report. " * 25


def _main_turns(n: int) -> list[list[tuple[str, str]]]:
    # Short turns on a long prefix: each turn adds ~4% to it, as a tool call and its
    # result add little to an agent's 28K-token conversation.
    messages, out = [("system", MAIN_SYSTEM)], []
    for i in range(n):
        messages.append(("user", f"Step {i}: " + "look into the failing build please " * 4))
        out.append(list(messages))
        messages.append(("assistant", f"Done {i}: " + "I checked this and that file " * 3))
    return out


def _subagent_turns(k: int) -> list[list[tuple[str, str]]]:
    messages, out = [("system", _subagent_system(k))], []
    for i in range(2):
        messages.append(("user", f"Task {i}: find uses of symbol{k} " * 8))
        out.append(list(messages))
        messages.append(("assistant", f"Found {i}: " + "in a file " * 10))
    return out


def _kv_per_token(model) -> int:
    # The dense test model's KV: layers x KV heads x head dims x (keys, values) x float32.
    text = model.model.args
    return text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 2 * 4


def test_five_subagents_leave_the_main_agents_next_turn_cached():
    model = loaded_test_model("dense")
    main = _main_turns(5)
    subagents = [_subagent_turns(k) for k in range(5)]
    config = EngineConfig(prefetch_next_turn=False)  # one request at a time, as measured
    with open_engine(model, TEST_CACHE, config) as cold_engine:
        cold_main = run(cold_engine, chat(*main[-1]), cache=False, sampling=EXACT)
        cold_sub = [run(cold_engine, chat(*s[-1]), cache=False) for s in subagents]
    # What the budget holds: the main agent's whole conversation and two subagents'.
    tokens = cold_main.usage.prompt_tokens + 2 * max(r.usage.prompt_tokens for r in cold_sub)
    budget = tokens * _kv_per_token(model)
    cache = CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64)
    with open_engine(model, cache, config) as engine:
        previous = 0
        for messages in main[:-1]:
            turn = run(engine, chat(*messages))
            assert turn.usage.cached_tokens >= previous  # the budget holds the main agent
            previous = turn.usage.prompt_tokens
        for turns in subagents:
            for messages in turns:
                run(engine, chat(*messages))
        back = run(engine, chat(*main[-1]), sampling=EXACT)
    assert back.usage.cached_tokens >= 0.95 * back.usage.prompt_tokens, back.usage
    assert (back.tokens, back.logprobs) == (cold_main.tokens, cold_main.logprobs)


def test_five_subagents_starting_together_on_one_system_prompt_prefill_it_once(make_engine):
    # Five subagents of one kind (one system prompt, each its own task) sent at once to
    # a cold cache: the first computes the system prompt, the other four restore it
    # while it runs (in-flight sharing), as prefill token counts say. Batch-invariant
    # decode: each answer is compared with its own run alone below.
    engine = make_engine("dense", cache_config=TEST_CACHE, deterministic=True)
    system = _subagent_system(7)
    prompts = [
        chat(("system", system), ("user", f"Task: find uses of symbol{k} " * 4)) for k in range(5)
    ]
    handles = submit_together(engine, prompts, GREEDY)
    results = []
    for handle in handles:
        tokens, usage = [], None
        for event in handle.events(timeout=600):
            if isinstance(event, TokenEvent) and event.token is not None:
                tokens.append(event.token)
            elif isinstance(event, DoneEvent):
                usage = event.usage
        assert usage is not None
        results.append((tokens, usage))
    planned = [engine.plan(p).tokens for p in prompts]
    shared = engine.planner.grid.align(planned[1], common_prefix_length(planned[0], planned[1]))
    assert shared >= 0.9 * len(engine.plan(chat(("system", system))).tokens)
    computed = [u.prompt_tokens - u.cached_tokens for _, u in results]
    # Only the first computed the system prompt: every other one restored all of it.
    assert results[0][1].cached_tokens == 0
    assert all(u.cached_tokens >= shared for _, u in results[1:]), computed
    assert sum(computed) <= sum(len(t) for t in planned) - 4 * shared
    for (tokens, _), prompt in zip(results, prompts, strict=True):
        assert tokens == run(engine, prompt, cache=False).tokens
    engine.store.check_integrity()
