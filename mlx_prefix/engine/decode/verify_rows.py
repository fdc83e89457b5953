"""A verify step of several requests decoding together (prompt lookup): each row's input
and its own drafted tokens (none: the row decodes one position, as a plain step would)
in one forward of rows of different lengths, then each row drawn in order by its own
sampler (engine/decode/verify.py `draw_row`), and the batch cache settled to what each
row kept (DecodeBatch.settle_rows): the rows of attention KV stay left-padded, ending
together, the fewest of them moved (cache/layers/rewind.py `keep_rows`; a sliding window
moves a row that kept fewer right, `shift_rows`).

Recurrent layers (mlx-lm's ArraysCache: conv and SSM state) keep no per-position
history. They are held before the verify (cache/layers/rewind.py `hold_recurrent`), and
a shorter row's pads are masked out of its state (`row_lengths`; Mamba-2's scan steps
position by position, and a mixer that takes no mask (Mamba-1, RG-LRU, RWKV-7) steps
whole, a pad's state selected away: engine/forward/stepwise.py). A row that kept all its positions
keeps the verify's state; the rows that kept fewer get their held state back and their
kept positions computed again, in one second forward of the batch (padded the same
way; the other rows masked out of it, their positions of it dropped), so that it costs
one forward of as many positions as the longest of those rows kept, whatever the others.
Only models whose recurrent layers honour `lengths` (RECURRENT_MASKED). Engine thread
only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from mlx_prefix.cache.layers.rewind import (
    HeldRows,
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

Held = HeldRows | None  # a verify's recurrent layers (None: its cache trims back)
# Models whose scans `verify_forward` made step position by position (by id, the model
# itself held weakly: a model unloaded leaves, and a new one at its id is not it).
_installed: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

# mlx-lm model modules whose recurrent layers stop each row's state at ArraysCache's
# `lengths` (a masked scan, the convolution's window taken at the row's end; Mamba-2's
# scan, and the mixers that take no mask, stepped position by position: stepwise.py).
RECURRENT_MASKED = frozenset(
    f"mlx_lm.models.{name}"
    for name in (
        *("qwen3_5", "qwen3_5_moe", "qwen3_next"),  # GatedDeltaNet
        *("nemotron_h", "mamba2", "falcon_h1", "granitemoehybrid", "plamo2"),  # Mamba-2
        *("lfm2", "lfm2_moe"),  # short convolutions
        *("mamba", "jamba", "recurrent_gemma", "rwkv7"),  # Mamba-1, RG-LRU, RWKV-7: stepped
    )
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


def verify_forward(batch: DecodeBatch, rows: Sequence[Sequence[int]]) -> tuple[mx.array, Held]:
    """`batch.verify_rows(rows)` ([B, L, V] logits), its recurrent layers held before
    (None: the cache trims back) and each row's pads masked out of their state."""
    if _installed.get(id(batch.model)) is not batch.model:
        # Stepwise scans, and the padding skipped (a walk of every module).
        rowwise.install(batch.model)
        _installed[id(batch.model)] = batch.model
    held = None if trims_back(batch.cache) else hold_recurrent(batch.cache)
    with _padded(batch, [len(row) for row in rows]):
        return batch.verify_rows(rows), held


def settle_verified(
    batch: DecodeBatch,
    rows: Sequence[Sequence[int]],
    held: Held,
    left: Sequence[int],
    kept: Sequence[int],
    last: Sequence[int],
) -> None:
    """Settle the batch after `verify_forward(rows)`: the rows still in it (`left`,
    their indices in `rows`) keep `kept` of the verify's positions and go on with
    `last`. A recurrent row that kept fewer than it verified is put back and its kept
    positions computed again, in one forward of the batch where every other row, its
    state the verify's, is masked out (and its positions of that forward dropped)."""
    redo = [n < len(rows[i]) for i, n in zip(left, kept, strict=True)]
    if held is None or not any(redo):
        batch.settle_rows(kept, last)
        return
    width = max(len(row) for row in rows)
    most = max((n for n, r in zip(kept, redo, strict=True) if not r), default=0)
    held.restore(redo, keep=left if len(left) < len(rows) else None)
    # A row put back holds none of the verify's positions; the others their kept ones.
    shifts = [most if r else most - n for n, r in zip(kept, redo, strict=True)]
    shift_rows(batch.cache, width - most, shifts)
    again = [n if r else 0 for n, r in zip(kept, redo, strict=True)]
    with _padded(batch, again):
        batch.recompute_rows([rows[i][: max(n, 1)] for i, n in zip(left, again, strict=True)])
    batch.settle_rows(kept, last, computed=again)


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
    logits, held = verify_forward(batch, rows)
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
        at = {id(m): i for i, m in enumerate(members)}
        settle_verified(
            batch,
            rows,
            held,
            left=[at[id(m)] for m in staying],
            kept=[drawn[id(m)].kept for m in staying],
            last=[drawn[id(m)].last for m in staying],
        )
    return out
