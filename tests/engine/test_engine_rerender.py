"""Templates that re-render an earlier turn as the conversation grows (GLM-4.7, DeepSeek
V3.1, MiniMax M2 drop or move its reasoning): a scripted client's next turn restores at
the divergence itself, on a hybrid model (exact checkpoints only), and answers as a cold
run does."""

from __future__ import annotations

import pytest
from support.engine_helpers import EXACT, run
from support.template_models import (
    RERENDERING,
    TOOLS,
    calibrated_once,
    chat_messages,
    template_model,
)

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.prompt.request.render import common_prefix_length
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts

# No periodic checkpoint past 32 x 2^k: only the turn starts can serve a divergence.
CACHE = CacheConfig(budget_bytes=1 << 30, prefill_chunk=32, checkpoint_interval=4096)


@pytest.mark.parametrize("family", RERENDERING)
def test_each_turn_restores_at_its_divergence_and_answers_as_cold(family):
    with calibrated_once():
        engine = Engine(
            template_model(family, "qwen3_5"), CACHE, EngineConfig(prefetch_next_turn=False)
        )
        converse(engine)


def converse(engine: Engine) -> None:
    grid = engine.planner.grid
    try:
        previous: tuple[int, ...] | None = None
        for turn in range(4):
            prompt = PromptInput(
                messages=conversation_from_dicts(chat_messages(turn)), tools=tuple(TOOLS)
            )
            tokens = engine.plan(prompt).tokens
            warm = run(engine, prompt, sampling=EXACT)
            if previous is not None:
                # The previous prompt ends inside an assistant turn's opening (`<think>`);
                # a re-rendered turn diverges just after its opening, further back.
                shared = common_prefix_length(previous, tokens)
                opened = max(p for p in grid.turn_starts(tokens) if p <= shared)
                assert warm.usage.cached_tokens == grid.align(tokens, shared) >= opened, turn
                cold = run(engine, prompt, cache=False, sampling=EXACT)
                assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
            previous = tokens
    finally:
        engine.shutdown()
