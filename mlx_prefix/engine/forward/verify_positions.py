"""A verify forward's positions (rowwise.py's `batched(..., verify=True)`): the padding
after a shorter row not computed at all and, with --deterministic, each row's positions
computed as the decode steps at them would.

Several requests verifying together (engine/decode/verify_rows.py) run one forward
[B, L], L the longest row: a shorter row is padded at its end. Its padding positions are
dropped after the verify (DecodeBatch.settle_rows) and, causal, no real position reads
them: so nothing needs their numbers. On a CPU every computed position costs time of its
own (its attention over the whole context, its share of the projections), so computing
the padding would make a row that drafts nothing, beside one that drafts 8, cost 9
positions: with --deterministic a verify of 4 requests where one drafts cost 3.4 plain
steps instead of about one, and by default 3.1 steps against 1.9 without its padding
(SmolLM2, 2,000 tokens of context each). So the projections take only the real
positions (each row's group changes none of its numbers: rowwise.py; by default one
call of them all) and the padding's outputs are zeros, as is its attention (with
--deterministic one call per position, by default one per row). Measured on a CPU
only: on a GPU a padded position is nearly free, and the per-row calls are launches.
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


def packed(base, x: mx.array, widths: Sequence[int] | None) -> mx.array:
    """`base(x)` of a default-mode verify's rows [B, L, D]: each row's own positions in
    one call of them all, zeros at the padding."""
    batch, length, dims = x.shape
    if length == 1:
        return base(x)
    rows = real_positions(x, widths)
    out = base(rows.reshape(1, len(rows), dims))
    return padded(out.reshape(len(rows), 1, out.shape[-1]), widths, batch, length)


def verify_attention(
    base, lengths: Sequence[int], widths: Sequence[int] | None, exact: bool, *args
) -> mx.array:
    """A verify's attention (`args`: queries, keys, values, cache, scale, mask, sinks),
    row by row: with `exact`, each position as its decode step's (`verify_sdpa`); by
    default each row in one call (`row_sdpa`); the padding past `widths` zeros."""
    queries = args[0]
    widths = widths or (queries.shape[2],) * len(lengths)
    if exact:
        rows = [verify_sdpa(base, n, widths[row], row, *args) for row, n in enumerate(lengths)]
    else:
        rows = [row_sdpa(base, w, row, *args) for row, w in enumerate(widths)]
    return mx.concatenate(rows) if len(rows) > 1 else rows[0]


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


def row_sdpa(
    base, width: int, row: int, queries, keys, values, cache, scale, mask, sinks
) -> mx.array:
    """Batch row `row`'s first `width` queries of L attending as the model's own call
    would (a default-mode verify: one call for the row), over the keys up to its own
    last position; its queries past `width` are padding: zeros, computed by nobody."""
    n, held = queries.shape[2], keys.shape[2]
    end = held - (n - width)  # a causal mask aligns the queries with the keys' end
    if isinstance(mask, mx.array):
        mask = mask[row : row + 1] if mask.shape[0] > 1 else mask
        mask = mask[..., :width, :end]
    out = base(
        queries[row : row + 1, :, :width],
        keys[row : row + 1, :, :end],
        values[row : row + 1, :, :end],
        cache=cache,
        scale=scale,
        mask=mask,
        sinks=sinks,
    )
    if width < n:
        heads, dims = queries.shape[1], values.shape[-1]
        out = mx.concatenate([out, mx.zeros((1, heads, n - width, dims), dtype=out.dtype)], axis=2)
    return out
