"""A verify step of several requests decoding together (prompt lookup): each row's input
and its own drafted tokens (none: the row decodes one position, as a plain step would)
in one forward of rows of different lengths, then each row drawn in order by its own
sampler (engine/decode/verify.py `draw_row`), and the batch cache settled to what each
row kept (DecodeBatch.settle_rows): attention KV and sliding windows move a row that
kept fewer right, to stay left-padded (cache/layers/rewind.py `shift_rows`).

Recurrent layers (mlx-lm's ArraysCache: conv and SSM state) keep no per-position
history. They are held before the verify (cache/layers/rewind.py `hold`), and a shorter
row's pads are masked out of its state (`row_lengths`; Mamba-2's scan steps position by
position, engine/forward/stepwise.py). If every row kept all its positions, the verify's
state is each row's; otherwise the recurrent layers are put back, the attention layers
trimmed by the verify's width, and every row's kept positions computed again in one
second forward (padded the same way), so that rows stay in step: a row that kept all is
computed again too (one forward of the batch either way), its numbers the verify's.
Only models whose recurrent layers honour `lengths` (RECURRENT_MASKED). Engine thread
only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from mlx_prefix.cache.layers.rewind import (
    Held,
    hold_recurrent,
    row_lengths,
    rows_settle,
    shift_rows,
    trims_back,
)
from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.verify import Accept, Drawn, SpeculationStats, draw_row
from mlx_prefix.engine.forward import rowwise, stepwise

# mlx-lm model modules whose recurrent layers stop each row's state at ArraysCache's
# `lengths` (a masked scan, the convolution's window taken at the row's end).
RECURRENT_MASKED = frozenset(
    f"mlx_lm.models.{name}" for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h")
)


def rows_verifiable(batch: DecodeBatch) -> bool:
    """Whether every layer of the batch cache can settle rows that kept different
    counts (a lone row only trims: engine/decode/verify.py `verify_step`)."""
    batch.join()
    if not rows_settle(batch.cache):
        return False
    return trims_back(batch.cache) or type(batch.model).__module__ in RECURRENT_MASKED


@contextmanager
def _padded(batch: DecodeBatch, lengths: Sequence[int]) -> Iterator[None]:
    """A forward of rows of `lengths` padded at their end: the pads stay out of every
    recurrent state."""
    with row_lengths(batch.cache, lengths), stepwise.positionwise():
        yield


def verify_rows(
    batch: DecodeBatch,
    drafts: Sequence[Sequence[int]],
    accept: Callable[[Running], Accept],
    stats: SpeculationStats,
) -> list[tuple[Running, Drawn]]:
    """Verify each member's `drafts[i]` (in member order; [] for a row without a draft)
    in one forward; every row hands its tokens to `accept(member)`, in order, until one
    ends its request or differs from its draft. Returns each member's draws."""
    members: list[Running] = list(batch.members)
    samplers = [batch.sampler(i) for i in range(len(members))]
    inputs = [
        r.emitted[-1] if r.emitted else r.job.tokens[-1] for r in members
    ]  # each row's newest token: the batch's next input
    rows = [[t, *d] for t, d in zip(inputs, drafts, strict=True)]
    held: Held | None = None
    if not trims_back(batch.cache):
        rowwise.install(batch.model)  # stepwise scans (idempotent)
        held = hold_recurrent(batch.cache)
    with _padded(batch, [len(row) for row in rows]):
        logits = batch.verify_rows(rows)
    # Counted before any token is handed on: a request's last one may end it, and its
    # client may read the counters as soon as it has its reply.
    stats.steps += 1
    stats.drafted += sum(len(d) for d in drafts)
    drawn: dict[int, Drawn] = {}
    out = []
    for row, (running, sampler, drafted) in enumerate(zip(members, samplers, drafts, strict=True)):
        # A request that ends leaves the batch at once (its row filtered out of the
        # cache); the others' rows, still unsettled, settle after all are drawn.
        result = draw_row(logits[row], sampler, running, drafted, accept(running), stats)
        drawn[id(running)] = result
        out.append((running, result))
    staying = batch.members
    if not staying:
        return out
    kept = [drawn[id(m)].kept for m in staying]
    if held is not None:
        at = {id(m): i for i, m in enumerate(members)}
        left = [at[id(m)] for m in staying]
        if any(n < len(rows[i]) for n, i in zip(kept, left, strict=True)):
            held.restore(keep=left if len(left) < len(members) else None)
            shift_rows(batch.cache, max(len(row) for row in rows), [0] * len(left))
            again = [rows[i][:n] for n, i in zip(kept, left, strict=True)]
            with _padded(batch, kept):
                batch.recompute_rows(again)
    batch.settle_rows(kept, [drawn[id(m)].last for m in staying])
    return out
