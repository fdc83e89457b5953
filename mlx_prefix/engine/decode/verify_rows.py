"""A verify step of several requests decoding together (prompt lookup): each row's input
and its own drafted tokens (none: the row decodes one position, as a plain step would)
in one forward of rows of different lengths, then each row drawn in order by its own
sampler (engine/decode/verify.py `draw_row`), and the batch cache settled to what each
row kept (DecodeBatch.settle_rows). Only over mlx-lm's BatchKVCache layers, whose rows
move right to stay left-padded. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlx_lm.models.cache import BatchKVCache

from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.verify import Accept, Drawn, SpeculationStats, draw_row


def rows_verifiable(batch: DecodeBatch) -> bool:
    """Whether every layer of the batch cache can settle rows that kept different
    counts (a lone row only trims: engine/decode/verify.py `verify_step`)."""
    batch.join()
    return all(type(c) is BatchKVCache for c in batch.cache)


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
    logits = batch.verify_rows([[t, *d] for t, d in zip(inputs, drafts, strict=True)])
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
    if staying:
        batch.settle_rows(
            [drawn[id(m)].kept for m in staying], [drawn[id(m)].last for m in staying]
        )
    return out
