"""What the process holds beside the cache budget: garbage cycles and MLX's buffer cache."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from support.engine_helpers import chat, run
from support.models import TEST_CACHE

from mlx_prefix.config import CacheConfig

PROMPTS = [chat(("system", "Be brief. " * 12), ("user", f"Question {i}: why?")) for i in range(3)]


def _mlx_garbage() -> list[object]:
    """MLX arrays and mlx-lm cache objects that only the cyclic collector would free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return [
            o
            for o in gc.garbage
            if isinstance(o, mx.array) or type(o).__module__.startswith("mlx_lm.models.cache")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_a_finished_request_leaves_its_cache_to_no_garbage_cycle(make_engine, kind):
    # Python's full collection runs rarely: a request's cache caught in a cycle stayed
    # alive (its whole KV, outside the budget) long after the store evicted its entry.
    engine = make_engine(kind)
    run(engine, PROMPTS[0])  # one-time set-up garbage, if any, before the count
    gc.collect()
    gc.disable()
    try:
        for prompt in PROMPTS:
            run(engine, prompt)
        assert run(engine, PROMPTS[0]).usage.cached_tokens > 0  # the cache was in use
        assert _mlx_garbage() == []
    finally:
        gc.enable()


def test_the_engine_caps_mlx_buffer_cache_at_a_quarter_of_the_budget(make_engine):
    budget = 16 << 20
    before = mx.set_cache_limit(1 << 40)  # MLX's default is above the cap everywhere
    try:
        make_engine(
            "dense",
            cache_config=CacheConfig(budget_bytes=budget, prefill_chunk=32, checkpoint_interval=64),
        )
        assert mx.set_cache_limit(1 << 40) == budget // 4
        # A bigger budget never raises a smaller limit (another engine's, or the user's).
        mx.set_cache_limit(1 << 20)
        make_engine("dense", cache_config=TEST_CACHE)
        assert mx.set_cache_limit(1 << 40) == 1 << 20
    finally:
        mx.set_cache_limit(before)
