"""What a request brings as it joins the decode batch: its Arrival (the prompt's cache
and last logits) and its sampler, which draws its first token from those logits
(sampling.draw_token) and every token after it.

DecodePhase.admit (engine/decode/phase.py) takes Arrivals from the engine loop
(engine/loop.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_prefix.engine.decode.running import HandBack
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.engine.decode.speculative import DraftCache
from mlx_prefix.engine.requests.jobs import Job
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
