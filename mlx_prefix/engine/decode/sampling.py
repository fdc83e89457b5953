"""Per-request token sampling that does not depend on what else is in the batch.

Each request owns its PRNG key chain (from its seed, or a random one), so a seeded
request samples the same tokens whether it decodes alone or next to others. Its row
goes, alone, through mlx_lm.server's steps in mlx_lm's order: logits processors
(engine/decode/logits.py), then, with a constraint (engine/decode/constraints.py), only the tokens
it allows, then top_p, min_p, XTC, top_k (mlx_lm.sample_utils' filters), then a draw at
the temperature - or the argmax at temperature 0. mlx_lm draws XTC's coin and the token
from the global PRNG; here both come from the request's own keys.

Reported logprobs stay the model's (before processors, constraint and filters).
Tokens forced on a sampler (`force`: a reasoning budget's close, engine/decode/reasoning_budget.py)
come out instead of sampled ones, one per call.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, apply_xtc

from mlx_prefix.engine.decode.logits import LogitsAdjuster
from mlx_prefix.engine.requests.jobs import Constraint
from mlx_prefix.records import SamplingParams, TopLogprob

XTC_SALT = 0x58_54_43  # "XTC": a different seed for the coin chain, still in 64 bits


class TokenSampler:
    def __init__(
        self,
        params: SamplingParams,
        constraint: Constraint | None = None,
        prompt_tokens: Sequence[int] = (),
        xtc_special_tokens: Sequence[int] = (),
    ):
        self.params = params
        self.constraint = constraint
        self.adjust = LogitsAdjuster(params, prompt_tokens)
        self._xtc_special = list(xtc_special_tokens)  # never cut by XTC (newline, EOS)
        # top_p 0 keeps only the most likely token (OpenAI accepts 0 <= top_p <= 1), and
        # so does top_k 1.
        self.greedy = params.temperature <= 0 or params.top_p <= 0 or params.top_k == 1
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._key = mx.random.key(seed)
        # XTC's coins from a chain of their own: the token draws are those of the same
        # seed without XTC, so what XTC changes is its cut alone.
        self._coin_key = mx.random.key(seed ^ XTC_SALT)
        self._forced: list[int] = []  # tokens to emit next instead of sampling

    def force(self, tokens: Sequence[int]) -> None:
        """The next calls return these tokens, in order."""
        self._forced += tokens

    @property
    def forcing(self) -> bool:
        return bool(self._forced)

    def __call__(self, logits: mx.array, logprobs: mx.array | None = None) -> mx.array:
        """Raw `logits` [1, V], and their normalized `logprobs` [1, V] where the caller
        has them already -> token [1] (lazy). A greedy row never normalizes: the argmax
        of the logits is that of the logprobs, and a vocabulary-wide logsumexp is a few
        percent of a small model's decode step on a CPU."""
        if self._forced:
            token = mx.array([self._forced.pop(0)])
            self.adjust.add(token)
            return token
        if self.adjust:
            logits, logprobs = self.adjust(logits), None
        if self.constraint is not None:
            allowed = self.constraint.allowed(logits.shape[-1])  # [V]
            logits, logprobs = mx.where(allowed, logits, -mx.inf), None
        if self.greedy:
            token = mx.argmax(logits, axis=-1)
        else:
            token = self._sample(normalize(logits) if logprobs is None else logprobs)
        self.adjust.add(token)
        return token

    def _sample(self, logprobs: mx.array) -> mx.array:
        p = self.params
        xtc = p.xtc_probability > 0
        self._key, key = mx.random.split(self._key)
        if xtc:
            self._coin_key, coin = mx.random.split(self._coin_key)
        if p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if xtc:
            # apply_xtc at probability 1 always cuts; whether to, the request's coin says.
            cut = apply_xtc(logprobs, 1.0, p.xtc_threshold, self._xtc_special)
            keep = mx.random.uniform(key=coin) > p.xtc_probability
            logprobs = mx.where(keep, logprobs, cut)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        return mx.random.categorical(logprobs * (1 / p.temperature), key=key)


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


def item_int(a: mx.array) -> int:
    """A one-element array's value as an int (a token id; evaluates it)."""
    return int(cast(int, a.item()))


def item_float(a: mx.array) -> float:
    """A one-element array's value as a float (a logprob; evaluates it)."""
    return cast(float, a.item())


def int_list(a: mx.array) -> list[int]:
    return cast("list[int]", a.tolist())


def float_list(a: mx.array) -> list[float]:
    return cast("list[float]", a.tolist())


def alternatives(ids: list[int], values: list[float], n: int) -> tuple[TopLogprob, ...]:
    """The first `n` of one row's `top_logprobs`, as records."""
    return tuple(TopLogprob(t, v) for t, v in zip(ids[:n], values[:n], strict=True))


def draw_token(
    logits: mx.array,
    params: SamplingParams,
    sampler: TokenSampler,
    agree: Callable[[mx.array], mx.array] | None = None,
) -> tuple[int, float | None, tuple[TopLogprob, ...]]:
    """One token drawn from one row of logits [1, V] by the request's sampler (on a
    sharded group, rank 0's: `agree`), with its logprob and alternatives when asked.
    A request's first token (from its prompt's last logits) and each verify draw."""
    logprobs = normalize(logits) if params.logprobs else None  # [1, V]
    token = sampler(logits, logprobs)  # [1]
    if agree is not None:
        token = agree(token)
    out = [token]
    if logprobs is not None:  # params.logprobs
        out.append(mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0])
        if params.top_logprobs:
            out.extend(top_logprobs(logprobs, params.top_logprobs))
    mx.eval(*out)
    logprob: float | None = None
    top: tuple[TopLogprob, ...] = ()
    if logprobs is not None:
        logprob = item_float(out[1])
        if params.top_logprobs:
            ids, values = int_list(out[2][0]), float_list(out[3][0])
            top = alternatives(ids, values, params.top_logprobs)
    return item_int(token), logprob, top
