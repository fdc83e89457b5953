"""A burst of requests sharing an uncached instruction computes it once."""

from __future__ import annotations

import pytest
from support.engine_helpers import GREEDY, chat, run, submit_together

from mlx_prefix.config import CacheConfig
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import DoneEvent, TokenEvent

INSTRUCTION = (
    "Translate the following text into plain, friendly English. Keep names unchanged, "
    "keep the paragraph structure, do not add commentary, and if a sentence is ambiguous "
    "choose the most common reading. The text follows after the colon: "
)
TEXTS = [f"Texte numero {i}: le train de {7 + i} heures part du quai {i}." for i in range(6)]


@pytest.mark.parametrize("kind", ["qwen3_5", "dense"])
def test_burst_sharing_one_instruction_prefills_it_once(make_engine, kind):
    # No periodic checkpoint could serve the shared prefix: only in-flight sharing can.
    # Batch-invariant: each answer is compared with its alone run's below.
    cache = CacheConfig(prefill_chunk=32, checkpoint_interval=4096)
    engine = make_engine(kind, cache_config=cache, deterministic=True)
    prompts = [chat(("user", INSTRUCTION + text)) for text in TEXTS]
    handles = submit_together(engine, prompts, GREEDY)
    results = []
    for handle in handles:
        tokens, usage = [], None
        for event in handle.events(timeout=120):
            if isinstance(event, TokenEvent) and event.token is not None:
                tokens.append(event.token)
            elif isinstance(event, DoneEvent):
                usage = event.usage
        results.append((tokens, usage))
    first = engine.plan(prompts[0]).tokens
    assert results[0][1].cached_tokens == 0
    for (_, usage), prompt in zip(results[1:], prompts[1:], strict=True):
        mine = engine.plan(prompt).tokens
        shared = engine.planner.grid.align(mine, common_prefix_length(first, mine))
        assert shared >= 2 * engine.cache_config.prefill_chunk
        assert usage.cached_tokens >= shared, "the shared instruction was computed again"
    for (tokens, _), prompt in zip(results, prompts, strict=True):
        assert tokens == run(engine, prompt, cache=False).tokens
    engine.store.check_integrity()
