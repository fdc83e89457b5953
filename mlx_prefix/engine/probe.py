"""Startup check that batching keeps this model's numbers, on this device and BLAS.

engine/forward/rowwise.py makes batched forwards batch-invariant for what was measured on this
CPU (OpenBLAS) and reasoned from MLX's Metal dispatch; a model with other layers (an
attention that bypasses mlx-lm's function, mixture-of-experts routing) or a backend
with other kernels could still break it. So once per engine the model computes a short
synthetic prompt both ways and the results are compared bit for bit: stacked prefill
chunks against the same chunks alone, and a decode batch of rows with different lengths
against each row alone. What fails is turned off: prefill runs each request's chunks
in their own forward, or requests decode one at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.forward.runner import ChunkWork, compute_chunks
from mlx_prefix.records import SamplingParams

log = logging.getLogger("mlx_prefix.engine")

_STEPS = 4  # decode steps compared
_MOST_PROMPTS = 5  # rows in the compared decode batch, at most (each also runs alone)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    stacked_prefill: bool  # equal-shape chunks may share a forward
    batched_decode: bool  # requests may decode in one batch


def probe(model: nn.Module, rows: int, vocab: int) -> ProbeResult:
    """Compare batched and alone forwards of `model` on synthetic tokens (engine thread)."""
    span = max(2, min(vocab, 1000) - 10)
    # Decode: up to 5 rows, past a narrow layer's row group (its rows then go as columns,
    # as in service); each layer's own groups are checked by rowwise.measure_rows.
    count = max(3, min(rows + 1, _MOST_PROMPTS))
    prompts = [[10 + (7 * i + 13 * k) % span for k in range(24 + 5 * i)] for i in range(count)]
    try:
        stacked = _prefill_matches(model, prompts[:3])
        decode = _decode_matches(model, prompts, rows)
    except Exception:  # a model whose caches cannot merge, say: run everything alone
        log.warning("batching probe failed; requests prefill and decode alone", exc_info=True)
        return ProbeResult(False, False)
    if not stacked:
        log.warning("stacked prefill changes this model's numbers here; chunks run alone")
    if not decode:
        log.warning("batched decode changes this model's numbers here; requests decode alone")
    return ProbeResult(stacked, decode)


def _prefill(model: nn.Module, prompts: list[list[int]], group: bool) -> list[list]:
    caches = [make_prompt_cache(model) for _ in prompts]
    # Two equal chunks [0, 16) then the unequal rest, as a burst restored from one point.
    works = [ChunkWork(c, p, 0, 16) for c, p in zip(caches, prompts, strict=True)]
    compute_chunks(model, works, group)
    works = [ChunkWork(c, p, 16, len(p)) for c, p in zip(caches, prompts, strict=True)]
    logits = compute_chunks(model, works, group)
    return [[x, *_arrays(c)] for x, c in zip(logits, caches, strict=True)]


def _prefill_matches(model: nn.Module, prompts: list[list[int]]) -> bool:
    together = _prefill(model, prompts, group=True)
    alone = [_prefill(model, [p], group=False)[0] for p in prompts]
    return all(_same(a, b) for a, b in zip(together, alone, strict=True))


def _decode(model: nn.Module, prompts: list[list[int]], rows: int) -> list[list]:
    batch = DecodeBatch(model, rows)
    for i, prompt in enumerate(prompts):
        cache = make_prompt_cache(model)
        compute_chunks(model, [ChunkWork(cache, prompt, 0, len(prompt))], group=False)
        batch.add(i, cache, TokenSampler(SamplingParams(temperature=0.0)), prompt[-1])
    out: list[list] = [[] for _ in prompts]
    for _ in range(_STEPS):
        for i, (_, row) in enumerate(batch.step(want_logprobs=True)):
            out[i].append((row.token, row.logprob))
    return out


def _decode_matches(model: nn.Module, prompts: list[list[int]], rows: int) -> bool:
    together = _decode(model, prompts, rows)
    # Every prompt's run, even after a mismatch: on a sharded model each is a collective.
    alone = [_decode(model, [p], rows)[0] for p in prompts]
    return all(a == b for a, b in zip(together, alone, strict=True))


def _arrays(cache: list) -> list[mx.array]:
    out: list[mx.array] = []

    def walk(x) -> None:
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    for c in cache:
        state = c.state
        if type(c).__name__ == "KVCache":  # the step-padded buffer past the offset is junk
            state = [a[..., : c.offset, :] for a in state[:2]]
        walk(state)
    return out


def _same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True)
    )
