"""What a request brings as it joins the decode batch: its Arrival (the prompt's cache
and last logits), its sampler, and its first token, sampled from those logits.

DecodePhase.admit (engine/decode/phase.py) takes Arrivals from the engine loop
(engine/loop.py); each row's sampler draws every token after the first too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_prefix.engine.decode.running import HandBack
from mlx_prefix.engine.decode.sampling import (
    TokenSampler,
    alternatives,
    float_list,
    int_list,
    item_float,
    item_int,
    normalize,
    top_logprobs,
)
from mlx_prefix.engine.decode.speculative import DraftCache
from mlx_prefix.engine.requests.jobs import Job
from mlx_prefix.records import SamplingParams, TopLogprob
from mlx_prefix.vision.key import unsalt

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request whose prompt is computed, as it joins the decode batch."""

    job: Job
    cache: list  # its prompt's cache, merged into the batch
    logits: mx.array  # the prompt's last logits [1, V]: its first token is sampled from them
    limit: int  # completion tokens it may produce (cut at the context's end)
    reuse: int  # prompt tokens restored from the cache
    prefill_tps: float  # prompt tokens computed per second of its prefill
    draft: DraftCache | None = None  # --draft-model: the draft's cache of the prompt
    bytes_key: str = ""  # its prefill's bytes in the store's budget, the batch's once merged
    hand_back: HandBack | None = None  # its prompt's entry, stored when it finishes


def sampler_for(job: Job, tokenizer: TokenizerWrapper) -> TokenSampler:
    """The request's own sampler, over its own history (its constraint, penalties)."""
    special: list[int] = []
    if job.sampling.xtc_probability > 0:  # as mlx_lm.server: XTC never cuts these
        special = tokenizer.encode("\n") + sorted(tokenizer.eos_token_ids)
    history: Sequence[int] = job.tokens
    if (vision := job.prompt.vision) is not None:  # the model's ids, not the key's
        history = unsalt(history, vision.family.placeholder)
    return TokenSampler(job.sampling, job.constraint, history, special)


def first_token(
    logits: mx.array,
    sampling: SamplingParams,
    sampler: TokenSampler,
    agree: Callable[[mx.array], mx.array] | None,
) -> tuple[int, float | None, tuple[TopLogprob, ...]]:
    """The first token, sampled from the prompt's last logits [1, V] (on a sharded
    group, rank 0's: `agree`), with its logprob and alternatives when asked."""
    logprobs = normalize(logits) if sampling.logprobs else None  # [1, V]
    first = sampler(logits, logprobs)  # [1]
    if agree is not None:
        first = agree(first)
    token = item_int(first)
    logprob: float | None = None
    top: tuple[TopLogprob, ...] = ()
    if logprobs is not None:  # sampling.logprobs
        logprob = item_float(logprobs[0, token])
        if n := sampling.top_logprobs:
            ids, values = top_logprobs(logprobs, n)
            mx.eval(ids, values)
            top = alternatives(int_list(ids[0]), float_list(values[0]), n)
    return token, logprob, top
