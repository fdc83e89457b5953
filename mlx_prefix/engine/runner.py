"""MLX work for one sequence: grid-chunked prefill with checkpoints, then decode.

Runs only on the engine thread (MLX streams are thread-local).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache
from mlx_lm.sample_utils import make_sampler

from mlx_prefix.engine.request import SamplingParams
from mlx_prefix.prompt.grid import ChunkGrid

# Layers whose state can always be trimmed back to any earlier position.
_ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)


def always_trimmable(cache: list) -> bool:
    """True when no layer can ever lose trimmability (no recurrent or rotating state):
    then one snapshot at the end of the prompt serves every shorter prefix."""
    return all(type(c) in _ALWAYS_TRIMMABLE for c in cache)


def _eval_cache(cache: list) -> None:
    mx.eval([c.state for c in cache])


@dataclass(frozen=True, slots=True)
class SampledToken:
    token: int
    logprob: float | None


def prefill(
    model: nn.Module,
    cache: list,
    tokens: Sequence[int],
    start: int,
    grid: ChunkGrid,
    on_boundary: Callable[[int], None],
    cancelled: Callable[[], bool] = lambda: False,
) -> mx.array | None:
    """Compute tokens[start:] into `cache` chunk by chunk on the grid.

    Calls on_boundary(p) after each chunk ending at p (the cache then holds exactly
    tokens[:p]). Returns the last position's logits [1, V], or None if cancelled.
    Intermediate chunks never evaluate the LM head: only the cache states are
    evaluated, and MLX computes nothing else.
    """
    position = start
    logits = None
    for end in grid.chunk_ends(tokens, start):
        inputs = mx.array(tokens[position:end])[None]  # [1, L]
        out = model(inputs, cache=cache)  # [1, L, V] (lazy)
        if end == len(tokens):
            logits = out[:, -1, :]
            mx.eval(logits, [c.state for c in cache])
        else:
            _eval_cache(cache)
        position = end
        on_boundary(end)
        if cancelled():
            return None
    return logits


def decode(
    model: nn.Module,
    cache: list,
    first_logits: mx.array,
    sampling: SamplingParams,
) -> Iterator[SampledToken]:
    """Yield sampled tokens forever; the caller stops iterating. The next step is
    dispatched (async_eval) before the current token is handed out, so the model
    computes while the caller detokenizes and streams."""
    sampler = make_sampler(temp=sampling.temperature, top_p=sampling.top_p)

    def sample(logits: mx.array) -> tuple[mx.array, mx.array | None]:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [1, V]
        token = sampler(logprobs)  # [1]
        chosen = logprobs[0, token[0]] if sampling.logprobs else None
        return token, chosen

    token, logprob = sample(first_logits)
    mx.async_eval(*[x for x in (token, logprob) if x is not None])
    while True:
        logits = model(token[:, None], cache=cache)[:, -1, :]  # [1, V]
        next_token, next_logprob = sample(logits)
        mx.async_eval(*[x for x in (next_token, next_logprob) if x is not None])
        yield SampledToken(int(token.item()), None if logprob is None else float(logprob.item()))
        token, logprob = next_token, next_logprob
