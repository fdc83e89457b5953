"""A batch-invariant verify forward's positions (rowwise.py's `batched(..., verify=True)`):
each row's positions computed as the decode steps at them would, and the padding after a
shorter row's own positions not computed at all.

Several requests verifying together (engine/decode/verify_rows.py) run one forward
[B, L], L the longest row: a shorter row is padded at its end. Its padding positions are
dropped after the verify (DecodeBatch.settle_rows) and, causal, no real position reads
them: so nothing needs their numbers. With --deterministic every verify position costs
about what a decode row does (its own attention call over exactly its keys, its rows in
the projections' measured groups), so computing the padding would make a row that drafts
nothing, beside one that drafts 8, cost 9 decode rows: a verify of 4 requests where one
drafts cost 3.4 plain steps instead of about one. So the projections take only the real
positions (each row's group changes none of its numbers: rowwise.py) and the padding's
outputs are zeros, as is its attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


def real_positions(x: mx.array, widths: Sequence[int] | None) -> mx.array:
    """A verify's rows [B, L, D] as decode rows [n, 1, D]: each row's first `widths[b]`
    positions (all of them without `widths`), in order."""
    batch, length, dims = x.shape
    if widths is None or all(w == length for w in widths):
        return x.reshape(batch * length, 1, dims)
    return mx.concatenate([x[b, :w] for b, w in enumerate(widths)])[:, None, :]


def padded(out: mx.array, widths: Sequence[int] | None, batch: int, length: int) -> mx.array:
    """The real positions' outputs [n, 1, W] back as [B, L, W], zeros at the padding."""
    width = out.shape[-1]
    if widths is None or all(w == length for w in widths):
        return out.reshape(batch, length, width)
    pieces, at = [], 0
    for w in widths:
        pieces.append(out[at : at + w, 0])
        at += w
        if w < length:
            pieces.append(mx.zeros((length - w, width), dtype=out.dtype))
    return mx.concatenate(pieces).reshape(batch, length, width)


def verify_sdpa(
    base, length: int, width: int, row: int, queries, keys, values, cache, scale, mask, sinks
) -> mx.array:
    """Batch row `row`'s query i of L attends as the decode step at its position would:
    over the keys held then (the last L-1-i are later positions') with that step's mask
    (`length`: the row's keys after the last position; left padding before them). Its
    queries past `width` are padding: zeros, computed by nobody."""
    n = queries.shape[2]
    held = keys.shape[2]
    if isinstance(mask, mx.array) and mask.shape[0] > 1:
        mask = mask[row : row + 1]
    outs = []
    for i in range(min(n, width)):
        end = held - (n - 1 - i)
        start = end - min(length - (n - 1 - i), end)
        row_mask = mask[..., i : i + 1, start:end] if isinstance(mask, mx.array) else None
        outs.append(
            base(
                queries[row : row + 1, :, i : i + 1],
                keys[row : row + 1, :, start:end],
                values[row : row + 1, :, start:end],
                cache=cache,
                scale=scale,
                mask=row_mask,
                sinks=sinks,
            )
        )
    if width < n:
        heads, dims = queries.shape[1], values.shape[-1]
        outs.append(mx.zeros((1, heads, n - width, dims), dtype=queries.dtype))
    return mx.concatenate(outs, axis=2)
