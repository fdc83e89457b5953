"""Per-request token sampling that does not depend on what else is in the batch.

Each request owns its PRNG key chain (from its seed, or a random one), so a seeded
request samples the same tokens whether it decodes alone or next to others.
"""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlx_prefix.records import SamplingParams, TopLogprob


class TokenSampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        # top_p 0 keeps only the most likely token (OpenAI accepts 0 <= top_p <= 1), and
        # so does top_k 1.
        self.greedy = params.temperature <= 0 or params.top_p <= 0 or params.top_k == 1
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        """logprobs [1, V] (normalized) -> token [1] (lazy)."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        self._key, key = mx.random.split(self._key)
        if 0 < self.params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.params.top_k)
        if self.params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.params.top_p)
        return mx.random.categorical(logprobs * (1 / self.params.temperature), key=key)


def normalize(logits: mx.array) -> mx.array:
    """logits [B, V] -> log-probabilities [B, V]."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def top_logprobs(logprobs: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """The `n` most likely tokens of each row, most likely first (lazy):
    logprobs [B, V] -> (token ids [B, n], their logprobs [B, n])."""
    ids = mx.argpartition(-logprobs, kth=n - 1, axis=-1)[:, :n]  # [B, n], unordered
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def alternatives(ids: list[int], values: list[float], n: int) -> tuple[TopLogprob, ...]:
    """The first `n` of one row's `top_logprobs`, as records."""
    return tuple(TopLogprob(t, v) for t, v in zip(ids[:n], values[:n], strict=True))
