"""One verify step: a lone request's input token and its drafted tokens computed in one
forward, then drawn in order by its own sampler (engine/decode/speculative.py explains why
the reply is plain decoding's, tokens and logprobs). Shared by the draft model
(speculative.py) and prompt lookup (lookup.py). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.sampling import TokenSampler, draw_token
from mlx_prefix.records import TopLogprob

# Hands one token to its request: (token, logprob, top) -> True if the request ended.
Accept = Callable[[int, float | None, tuple[TopLogprob, ...]], bool]


@dataclass(slots=True)
class SpeculationStats:
    """Verify steps run and the draft tokens they checked (observability, tests)."""

    steps: int = 0
    drafted: int = 0  # tokens the draft proposed
    accepted: int = 0  # of those, tokens the target drew too
    draft_restored: int = 0  # prompt tokens of the draft's cache restored with the target's
    draft_computed: int = 0  # prompt tokens the draft computed (a miss, or an entry without it)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def verify_step(
    batch: DecodeBatch,
    running: Running,
    drafted: Sequence[int],
    accept: Accept,
    stats: SpeculationStats,
) -> tuple[int, int]:
    """Verify `drafted` (k >= 1 tokens after the request's sequence) for the batch's only
    request: up to k+1 tokens handed to `accept`, in order, until one ends the request or
    differs from the draft. Returns the tokens handed on and, of those, the drafted
    tokens the reply kept."""
    assert len(batch) == 1 and drafted
    k = len(drafted)
    sequence_last = running.emitted[-1] if running.emitted else running.job.tokens[-1]
    held = len(running.job.tokens) + len(running.emitted) - 1  # tokens in the cache
    logits = batch.verify([sequence_last, *drafted])  # [k+1, V]
    # Counted before any token is handed on: the last one may end the request, and
    # its client may read the counters as soon as it has its reply.
    stats.steps += 1
    stats.drafted += k
    drawn = draw_row(logits, batch.sampler(0), running, drafted, accept, stats)
    if not drawn.ended:
        batch.settle(held + drawn.kept, drawn.last, k + 1 - drawn.kept)
    return drawn.kept, drawn.hits


@dataclass(frozen=True, slots=True)
class Drawn:
    """What a row's draws in a verify kept."""

    kept: int  # positions of the verify forward the reply keeps
    hits: int  # of those, drafted tokens the sampler drew too
    last: int  # the last token drawn: the row's next input
    ended: bool  # a token ended the request (it left the batch)


def draw_row(
    logits: mx.array,
    sampler: TokenSampler,
    running: Running,
    drafted: Sequence[int],
    accept: Accept,
    stats: SpeculationStats,
) -> Drawn:
    """A row's draws from its verify logits [L, V] (its input, then `drafted`), in order
    as plain decoding would draw them: each token handed to `accept` until one ends the
    request or differs from the draft (or the draft runs out)."""
    k = len(drafted)
    params = running.job.sampling
    kept = 0
    hits = 0
    while True:
        value, logprob, top = draw_token(logits[kept : kept + 1], params, sampler)
        kept += 1
        matched = kept <= k and value == drafted[kept - 1]
        stats.accepted += int(matched)
        hits += int(matched)
        if accept(value, logprob, top):
            return Drawn(kept, hits, value, ended=True)  # it ended (and left the batch)
        if not matched:
            return Drawn(kept, hits, value, ended=False)
