"""One request's logits processors: `logit_bias` and the repetition, presence and
frequency penalties, built by mlx_lm.sample_utils.make_logits_processors (the same
functions, the same order, the same meaning as mlx_lm.server).

The penalties look at the request's own token history: the last N tokens of its whole
prompt followed by its reply so far. That is what mlx_lm.server sees on a cold run; on
a cache hit mlx_lm.server sees only the prompt's uncached tail, so its penalties change
with the cache. Here the history does not depend on the cache (a hit gives a cold run's
answer), nor on the other requests decoding in the same batch (each row is processed
alone). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from mlx_prefix.records import SamplingParams


class LogitsAdjuster:
    """Applies a request's processors to its raw logits row; false when it has none."""

    def __init__(self, params: SamplingParams, prompt_tokens: Sequence[int]):
        self._processors = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size,
            presence_penalty=params.presence_penalty,
            presence_context_size=params.presence_context_size,
            frequency_penalty=params.frequency_penalty,
            frequency_context_size=params.frequency_context_size,
        )
        # Only as much history as the widest active penalty reads (0: logit_bias alone).
        self._window = max(
            (
                size
                for penalty, size in (
                    (params.repetition_penalty, params.repetition_context_size),
                    (params.presence_penalty, params.presence_context_size),
                    (params.frequency_penalty, params.frequency_context_size),
                )
                if penalty
            ),
            default=0,
        )
        tail = list(prompt_tokens[-self._window :]) if self._window else []
        self._history = mx.array(tail, dtype=mx.uint32)  # [<= window]

    def __bool__(self) -> bool:
        return bool(self._processors)

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [1, V] -> adjusted logits [1, V] (lazy)."""
        for processor in self._processors:
            logits = processor(self._history, logits)
        return logits

    def add(self, token: mx.array) -> None:
        """The request sampled `token` [1] (lazy): it joins the history."""
        if self._window:
            history = mx.concatenate([self._history, token.astype(mx.uint32)])
            self._history = history[-self._window :]
