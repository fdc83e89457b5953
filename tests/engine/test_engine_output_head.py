"""A prompt's last chunk applies the output head to its last position only
(engine/forward/head.py): the same logits up to rounding, the same cache bit for bit,
and every other forward as before."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.models import loaded_test_model

from mlx_prefix.engine.forward import head, rowwise
from mlx_prefix.engine.forward.head import LastPositionHead, last_position_head
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.models.testing import TEST_MODEL_KINDS

TOKENS = list(range(10, 40))


def _states(cache: list) -> list[mx.array]:
    return [a for c in cache for a in c.state if isinstance(a, mx.array)]


@pytest.mark.parametrize("kind", TEST_MODEL_KINDS)
def test_the_head_takes_the_last_position_only_inside_the_block(kind):
    """Tied heads (dense, qwen3_5, sliding) and an untied one (nemotron_h)."""
    model = loaded_test_model(kind).model
    found = head.install(model)
    assert found > 0 and head.install(model) == found  # idempotent
    full_cache, last_cache = make_prompt_cache(model), make_prompt_cache(model)
    full = model(mx.array(TOKENS)[None], cache=full_cache)
    with last_position_head():
        last = model(mx.array(TOKENS)[None], cache=last_cache)
    assert full.shape[1] == len(TOKENS) and last.shape[1] == 1  # and nothing leaks out
    assert mx.allclose(last[:, -1], full[:, -1], rtol=1e-4, atol=1e-4).item()
    for a, b in zip(_states(full_cache), _states(last_cache), strict=True):
        assert mx.array_equal(a, b).item()  # the head feeds no layer


def test_only_a_prompts_last_chunk_computes_the_head_on_one_position(monkeypatch):
    model = loaded_test_model("dense").model
    head.install(model)
    seen: list[int] = []
    real = head._last

    def spy(x):
        out = real(x)
        seen.append(out.shape[-2])
        return out

    monkeypatch.setattr(head, "_last", spy)
    cache = make_prompt_cache(model)
    middle, end = ChunkWork(cache, TOKENS, 0, 16), ChunkWork(cache, TOKENS, 16, len(TOKENS))
    assert compute_chunks(model, [middle]) == [None]
    assert seen == [16]  # built lazily over every position, and never evaluated
    (logits,) = compute_chunks(model, [end])
    assert seen == [16, 1] and logits.shape == (1, model(mx.array([[1]])).shape[-1])
    reference = make_prompt_cache(model)
    want = model(mx.array(TOKENS)[None], cache=reference)[:, -1]
    assert mx.allclose(logits, want, rtol=1e-4, atol=1e-4).item()


def test_deterministic_layers_still_reach_an_untied_head():
    """rowwise.install, run after (at calibration), still swaps the projection inside."""
    model = loaded_test_model("nemotron_h").model
    head.install(model)
    rowwise.install(model)
    wrapped = [m for _, m in model.named_modules() if isinstance(m, LastPositionHead)]
    assert wrapped
    for w in wrapped:
        assert isinstance(w.head, nn.Linear) and type(w.head) is not nn.Linear
