"""Grouped prefill (engine/forward/runner.py compute_chunks, engine/forward/rowwise.py):
chunks of several sequences computed together give each sequence the numbers of its
alone run, bit for bit (--deterministic's stacked prefill; the default computes each
chunk alone)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.models import loaded_test_model

from mlx_prefix.cache.snapshot import capture, restore
from mlx_prefix.engine.forward import rowwise, runner
from mlx_prefix.engine.forward.runner import ChunkWork, PrefillCursor, compute_chunks, prefill
from mlx_prefix.prompt.request.grid import ChunkGrid

GRID = ChunkGrid(16)
KINDS = ["dense", "qwen3_5", "nemotron_h", "sliding"]


def _prompts(n: int, shared: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(10, 2000) for _ in range(shared)]
    return [head + [rng.randrange(10, 2000) for _ in range(k)] for k in lengths[:n]]


def _alone(model, prompt, start=0, snapshot=None) -> tuple[mx.array, list]:
    cache = restore(snapshot) if snapshot is not None else make_prompt_cache(model)
    return prefill(model, cache, prompt, start, GRID, lambda p: None), cache


def _together(model, prompts, start=0, snapshot=None) -> tuple[list, list]:
    """All prompts prefilled side by side, one chunk each per step."""
    caches = [
        restore(snapshot) if snapshot is not None else make_prompt_cache(model) for _ in prompts
    ]
    cursors = [PrefillCursor(p, start, GRID) for p in prompts]
    final: list = [None] * len(prompts)
    while not all(c.done for c in cursors):
        live = [i for i, c in enumerate(cursors) if not c.done]
        works = [ChunkWork(caches[i], prompts[i], *cursors[i].next_chunk()) for i in live]
        for i, logits in zip(live, compute_chunks(model, works), strict=True):
            cursors[i].advance()
            if logits is not None:
                final[i] = logits
    return final, caches


def _states(cache) -> list[mx.array]:
    out = []
    for c in cache:
        state = c.state
        arrays = [a for a in (state if isinstance(state, (list, tuple)) else [state])]
        flat = []
        while arrays:
            a = arrays.pop(0)
            if isinstance(a, (list, tuple)):
                arrays[:0] = list(a)
            elif isinstance(a, mx.array):
                flat.append(a)
        offset = getattr(c, "offset", None)
        if type(c).__name__ == "KVCache":
            flat = [a[..., :offset, :] for a in flat]
        out.extend(flat)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_side_by_side_prefill_equals_alone_bit_for_bit(kind, monkeypatch):
    model = loaded_test_model(kind).model
    rowwise.install(model)
    stacked = []

    def counting():
        stacked.append(1)
        return rowwise.batched()

    monkeypatch.setattr(runner, "batched", counting)
    # Cold: equal first chunks (grouped), then chunks of different lengths (alone).
    prompts = _prompts(3, 40, [30, 30, 9])
    together, caches = _together(model, prompts)
    for prompt, logits, cache in zip(prompts, together, caches, strict=True):
        alone, alone_cache = _alone(model, prompt)
        assert mx.array_equal(logits, alone).item(), "grouping changed the logits"
        got, want = _states(cache), _states(alone_cache)
        assert len(got) == len(want)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
    # Warm: restored from one shared checkpoint, as a burst on a shared instruction is.
    shared = prompts[0][:48]
    base = make_prompt_cache(model)
    prefill(model, base, shared, 0, GRID, lambda p: None)
    snapshot = capture(base, 48)
    warm = _prompts(4, 48, [20, 20, 35, 5], seed=1)
    warm = [shared + p[48:] for p in warm]
    together, _ = _together(model, warm, 48, snapshot)
    for prompt, logits in zip(warm, together, strict=True):
        alone, _ = _alone(model, prompt, 48, snapshot)
        assert mx.array_equal(logits, alone).item(), "grouping changed the logits"
    assert len(stacked) >= 6  # chunks really were stacked, cold and warm
