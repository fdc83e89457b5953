"""Prefill on the grid: restoring from any checkpoint gives bit-identical logits."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.engine_helpers import chat
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.cache.snapshot import capture, restore
from mlx_prefix.engine.forward.runner import prefill
from mlx_prefix.prompt.request.plan import PromptPlanner

PROMPT = chat(
    ("system", "You answer questions about trains, timetables and tickets, briefly. " * 4),
    ("user", "Which platform does the 9:15 to Leeds leave from, and is it on time today?"),
)


@pytest.mark.parametrize("kind", ["dense", "qwen3_5", "nemotron_h", "sliding"])
def test_restoring_any_checkpoint_reproduces_cold_logits_exactly(kind):
    loaded = loaded_test_model(kind)
    planner = PromptPlanner(loaded.tokenizer, TEST_CACHE)
    tokens = planner.plan(PROMPT).tokens
    snapshots = {}
    cache = make_prompt_cache(loaded.model)

    def keep(position):
        snapshots[position] = capture(cache, position)

    cold = prefill(loaded.model, cache, tokens, 0, planner.grid, keep)
    assert len(snapshots) >= 5
    for position, snapshot in snapshots.items():
        if position == len(tokens):
            continue
        warm_cache = restore(snapshot)
        warm = prefill(loaded.model, warm_cache, tokens, position, planner.grid, lambda p: None)
        assert mx.array_equal(warm, cold).item(), f"logits differ after restoring at {position}"
